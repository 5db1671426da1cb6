"""Answers to requests: the RPC handlers, and the room an answer may take.

:class:`Responder` runs the paper's four RPCs on an authenticated request whose arguments are
not yet checked, and seals the answer:

- ``store`` merges owner-signed dictionary entries (see :mod:`swarm.dht.store_intake`: budgets
  per host and subnet, signatures checked in order up to the first forged one, which the source
  pays for);
- ``find_value`` answers one fair page of a key's entries (at most one entry per owner, owners
  round-robin over the subnets and hosts that stored them, see :mod:`swarm.dht.listing`) with a
  ``next`` cursor, each entry's witnessed age *and* the closest contacts, so a reader can merge
  what several nodes hold instead of stopping at the first answer;
- answers carry a return-routability cookie (:mod:`swarm.dht.cookies`); a request without a
  valid one gets an answer no larger than itself (BEP 42, DNS cookies): a lookup's answer is cut
  to fit (the entries first, then the closest contacts), any other shrinks to the cookie alone,
  and only a sender that echoed one enters the routing table, so a spoofed source or a replayed
  first-contact ping cannot use us.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from swarm.dht.cookies import Cookies
from swarm.dht.envelope import ENVELOPE_OVERHEAD, RESPONSE, DatagramAuth
from swarm.dht.pages import answer_page, parse_cursor
from swarm.dht.records import KEY_DIGEST_BYTES, RecordStorage
from swarm.dht.request_format import LOOKUPS, Request
from swarm.dht.routing import Contact, SwarmRoutingTable
from swarm.dht.store_intake import StoreIntake
from swarm.errors import AuthError, DHTError
from swarm.refusal_log import RateLimitedWarning

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 60_000  # UDP carries up to 65,507; keep room for the envelope
FULL_ROOM = MAX_RESPONSE_BYTES - ENVELOPE_OVERHEAD  # room in an answer to a proved source
ROOM_SLACK = 16  # msgpack headers that grow with a list's length
LIST_HEADER = 3  # a msgpack array header, at most (up to 65,535 items)


class Responder:
    """Answers authenticated requests (see the module docstring).

    Args:
        auth: seals the answers.
        router: the routing table, for the closest contacts.
        storage: the node's record storage, read by ``find_value``.
        intake: admits the entries of a ``store``.
        welcome: takes a sender whose address is proved into the routing table.
        send: sends a datagram to an address.
        refusals: logs refused requests, rate-limited per source.
    """

    def __init__(
        self,
        auth: DatagramAuth,
        router: SwarmRoutingTable,
        storage: RecordStorage,
        intake: StoreIntake,
        welcome: Callable[[Contact], None],
        send: Callable[[tuple[str, int], bytes], None],
        refusals: RateLimitedWarning,
    ):
        self.auth = auth
        self.router = router
        self.storage = storage
        self.intake = intake
        self.cookies = Cookies()
        self.cut_to_request_size = 0  # answers to unproved sources cut down to the cookie
        self._welcome = welcome
        self._send = send
        self._refusals = refusals

    def answer(
        self, msg_id: bytes, sender: Contact, request: Request, targeted: bool, request_bytes: int
    ) -> None:
        """Answer ``request`` of ``request_bytes`` from ``sender``; ``targeted``: MAC'd for us
        (an untargeted first-contact ping never proves the address: a captured one replayed to
        another node gets a cookie back and files nobody)."""
        method, source = request.method, f"{sender.ip}:{sender.port}"
        verified = targeted and self.cookies.check(
            request.cookie, sender.address, sender.keys.public_key
        )
        cookie = b"" if verified else self.cookies.issue(sender.address, sender.keys.public_key)
        kwargs: dict[str, int] = {}
        if not verified and method in LOOKUPS:
            # BEP 42 / DNS cookies: an unproved source gets no more bytes than it sent; lookups
            # cut their answer to what is left of that after the envelope and the cookie
            bare = self.auth.seal(RESPONSE, msg_id, _skeleton(method, cookie), sender.keys)
            kwargs["room"] = request_bytes - len(bare) - ROOM_SLACK
        try:
            result = getattr(self, f"rpc_{method}")(sender, verified, *request.args, **kwargs)
        except (DHTError, AuthError, TypeError) as e:
            self._refusals.warn(source, "refused a DHT %s from %s: %s", method, source, e)
            result = {"error": str(e)[:200]}
        if not verified:
            result["cookie"] = cookie
        datagram = self.auth.seal(RESPONSE, msg_id, result, sender.keys)
        if not verified and len(datagram) > request_bytes:
            self.cut_to_request_size += 1
            small = {"cookie": cookie, "retry": True}
            datagram = self.auth.seal(RESPONSE, msg_id, small, sender.keys)
            if len(datagram) > request_bytes:
                return
        self._send(sender.address, datagram)

    # ---- the handlers (sender is authenticated; arguments are not yet checked)

    def rpc_ping(self, sender: Contact, verified: bool) -> Any:
        if verified:
            self._welcome(sender)
        return {"pong": True}

    def rpc_store(self, sender: Contact, verified: bool, key: Any, entries: Any) -> Any:
        _check_key(key)
        refused = self.storage.refused
        stored = self.intake.admit(sender.ip, sender.keys, key, entries)
        if self.storage.refused > refused:
            source = f"{sender.ip}:{sender.port}"
            self._refusals.warn(
                source,
                "DHT storage quota: refused %d entries from %s",
                self.storage.refused - refused,
                source,
            )
        if verified:
            self._welcome(sender)
        return {"stored": stored}

    def rpc_find_node(
        self, sender: Contact, verified: bool, target: Any, *, room: int = FULL_ROOM
    ) -> Any:
        """The closest contacts to ``target`` that fit in ``room`` bytes, closest first."""
        _check_key(target)
        if verified:
            self._welcome(sender)
        neighbours = self._neighbours(target, sender)
        nodes = neighbours[: _fitting(neighbours.sizes, room)]
        return {"nodes": nodes, "cut": True} if len(nodes) < len(neighbours) else {"nodes": nodes}

    def rpc_find_value(
        self,
        sender: Contact,
        verified: bool,
        key: Any,
        cursor: Any = None,
        *,
        room: int = FULL_ROOM,
    ) -> Any:
        """Entries of ``key`` one fair page at a time (see :meth:`RecordStorage.fair_order`).

        ``cursor`` is ``[round, index]`` from a previous answer's ``next`` (None: the first
        page, which also carries the closest contacts). In ``room`` bytes, the contacts get up to
        half, the entries what is left, and the contacts again whatever the entries did not use.
        """
        _check_key(key)
        start_round, start = parse_cursor(cursor)
        if verified:
            self._welcome(sender)
        neighbours = self._neighbours(key, sender) if cursor is None else _Packed()
        held_back = sum(neighbours.sizes[: _fitting(neighbours.sizes, room // 2)])
        page = answer_page(
            self.storage, key, start_round, start, room - held_back - 3 * LIST_HEADER
        )
        nodes = neighbours[: _fitting(neighbours.sizes, room - 2 * LIST_HEADER - page.used)]
        answer: dict[str, Any] = {
            "nodes": nodes,
            "entries": page.entries,
            "ages": page.ages,  # each entry's witnessed age here, whole seconds
            "next": page.next,
            "truncated": page.next is not None,
        }
        if len(nodes) < len(neighbours):
            answer["cut"] = True  # more contacts than fitted: a lookup may ask again
        if not verified and not page.entries and page.next is not None:
            answer["retry"] = True  # not even one entry fitted: ask again with the cookie
        return answer

    def _neighbours(self, target: bytes, sender: Contact) -> _Packed:
        found = self.router.closest(target, self.router.ksize, exclude=(sender.id,))
        return _Packed(c.to_wire() for c in found)


def _skeleton(method: str, cookie: bytes) -> dict[str, Any]:
    """The answer to ``method`` with nothing in it: its envelope is what a cut answer costs."""
    if method == "find_value":
        return {
            "nodes": [],
            "entries": [],
            "ages": [],
            "next": [0, 0],
            "truncated": True,
            "cookie": cookie,
            "retry": True,
            "cut": True,
        }
    if method == "find_node":
        return {"nodes": [], "cut": True, "cookie": cookie}
    return {"cookie": cookie}


class _Packed(list):
    """Wire items with the msgpack size of each, measured once (``sizes``)."""

    def __init__(self, items: Iterable[Any] = ()):
        super().__init__(items)
        self.sizes = [len(msgpack.packb(item, use_bin_type=True)) for item in self]


def _fitting(sizes: list[int], room: int) -> int:
    """How many items, from the first, fit in ``room`` bytes as one msgpack list."""
    used = LIST_HEADER
    for count, size in enumerate(sizes):
        used += size
        if used > room:
            return count
    return len(sizes)


def _check_key(key: Any) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_DIGEST_BYTES:
        raise DHTError(f"a DHT key is {KEY_DIGEST_BYTES} bytes")
