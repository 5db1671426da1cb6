"""The body of a DHT request (sans-I/O): its shape and arity checks, and the padding of a request
that carries no cookie.

A request body is ``[method, args]``, then optionally ``client``, ``cookie`` and ``padding``. A
request without a cookie is padded so that the answer carrying one may be no larger than the
request (see :mod:`swarm.dht.answers`); a lookup request without one is padded further, to
:data:`FIRST_CONTACT_LOOKUP_BYTES`, so that the answer to it may hold k = 20 contacts (3.3 KB)
and is not cut to a few: a lookup meeting new nodes does not pay a round trip per node for the
cookie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.dht.envelope import MAX_REQUEST_BYTES, REQUEST, DatagramAuth, SenderKeys
from swarm.errors import DHTError

METHODS = ("ping", "store", "find_node", "find_value")
LOOKUPS = ("find_node", "find_value")
ARITY = {"ping": (0,), "store": (2,), "find_node": (1,), "find_value": (1, 2)}
COOKIE_PAD_BYTES = 96  # padding of a request without a cookie
FIRST_CONTACT_LOOKUP_BYTES = 3584
MAX_PADDING_BYTES = FIRST_CONTACT_LOOKUP_BYTES


@dataclass(frozen=True)
class Request:
    """A parsed request body (its arguments not yet checked: the handler does that)."""

    method: str  # one of METHODS
    args: list[Any]  # as many as the method takes
    client: bool  # the sender only asks: it enters no routing table
    cookie: Any  # the cookie echoed back to us (None or b"": none; checked by the responder)


def parse_request(body: Any) -> Request:
    """Check a request body's shape, method, arity and padding.

    Raises:
        DHTError: anything else than a well-formed request body.
    """
    if not isinstance(body, list) or not 2 <= len(body) <= 5:
        raise DHTError("a request is [method, args, client?, cookie?, padding?]")
    method, args = body[:2]
    from_client = body[2] if len(body) >= 3 else False
    cookie = body[3] if len(body) >= 4 else None
    if len(body) == 5 and (not isinstance(body[4], bytes) or len(body[4]) > MAX_PADDING_BYTES):
        raise DHTError(f"request padding is at most {MAX_PADDING_BYTES} bytes")
    if not isinstance(from_client, bool):
        raise DHTError("the client flag of a request is a bool")
    if method not in METHODS:
        raise DHTError(f"unknown DHT method {str(method)[:32]!r}")
    if not isinstance(args, list) or len(args) > 2:
        raise DHTError("request arguments must be a short list")
    arity = ARITY[method]
    if len(args) not in arity:
        raise DHTError(f"{method} takes {arity[0]} argument(s), got {len(args)}")
    return Request(method, args, from_client, cookie)


def seal_request(
    auth: DatagramAuth,
    msg_id: bytes,
    request: Request,
    target: SenderKeys | None,
) -> bytes:
    """The sealed datagram of ``request``, padded when it echoes no cookie.

    Raises:
        AuthError: ``target`` cannot be addressed.
        DHTError: the request does not fit a datagram.
    """
    method, args, client, cookie = request.method, request.args, request.client, request.cookie
    if cookie is not None:
        datagram = auth.seal(REQUEST, msg_id, [method, args, client, cookie], target)
    else:  # room for a cookie in the answer: it may be no larger than this request
        body: list[Any] = [method, args, client, b"", bytes(COOKIE_PAD_BYTES)]
        datagram = auth.seal(REQUEST, msg_id, body, target)
        if method in LOOKUPS:  # and for a useful answer
            pad = COOKIE_PAD_BYTES + FIRST_CONTACT_LOOKUP_BYTES - len(datagram)
            body[4] = bytes(min(MAX_PADDING_BYTES, max(COOKIE_PAD_BYTES, pad)))
            datagram = auth.seal(REQUEST, msg_id, body, target)
    if len(datagram) > MAX_REQUEST_BYTES:
        raise DHTError(f"a {method} request of {len(datagram)} bytes does not fit a datagram")
    return datagram
