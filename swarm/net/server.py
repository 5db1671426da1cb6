"""The server side of a peer's transport: authentication, routes, and the limits around them.

Routes (every one needs a valid ``X-Swarm-Auth`` header, see :class:`swarm.auth.RequestAuth`):

- ``GET /ping``: RTT probe, answers ``pong``.
- ``GET /info``: this peer's signed :class:`~swarm.net.record.PeerRecord`.
- ``POST /stream/{name}``: a sealed stream (:mod:`swarm.net.frames`) to a registered handler.
- ``GET /metrics``: Prometheus text, without swarm authentication, when enabled.

Refusals: 401 (missing, malformed or bad signature, wrong swarm key, replay, addressed to another
peer, tampered or truncated body before the reply started), 403 (authenticated but not on the
allow-list), 413 (stream or frame too large), 429 (the source's host or subnet spent its
authentication budget), 400 (malformed stream), 404 (unknown stream), 500 (the handler failed
before replying). Each is logged at WARNING, rate-limited per source subnet. A handler that
answers 410 (this peer ended the exchange: the round the stream feeds is over here, or it
dropped a sender that stalled) says nothing bad of the sender: logged at DEBUG (the round's
report names drops).

Authentication work is budgeted per host and per subnet (:class:`~swarm.hosts.HostBuckets`,
never per address or port): every request costs one token, and a request that fails
authentication costs ``FAILED_AUTH_COST`` more, so forging costs the forger far more than it
costs us. A source out of tokens is answered 429 before any signature is checked. Cost to
honest peers: none below ``AUTH_RATE`` requests per second per host (sustained, with bursts
of ``AUTH_BURST``), eight times that per subnet; a swarm of many peers behind one address
that talks to one peer faster than that would see 429s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from swarm.address import PeerAddress
from swarm.auth import AUTH_HEADER, Membership, ReplayGuard, RequestAuth
from swarm.errors import GONE, AuthError, ConfigError, SwarmError, TransportError
from swarm.hosts import HostBuckets, scope_of
from swarm.identity import Identity, PeerID
from swarm.net.confidential import seal_reply
from swarm.net.connections import ConnectionLimits
from swarm.net.frames import TO_CLIENT, TO_SERVER, Opener, Sealer, stream_aead
from swarm.net.limits import StreamLimits
from swarm.net.reader import FrameReader
from swarm.net.record import PeerRecord
from swarm.net.streams import FrameWriter, InboundStream, RemotePeer, ReplyStream
from swarm.refusal_log import RateLimitedWarning

logger = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

StreamHandler = Callable[[InboundStream, ReplyStream], Awaitable[None]]

PUBLIC_PATHS = ("/ping", "/info")
METRICS_PATH = "/metrics"  # no swarm auth (Prometheus cannot sign); 404 unless enabled
AUTH_RATE = 200.0  # requests per second one host may have authenticated, sustained
AUTH_BURST = 2000.0  # ... and at once
FAILED_AUTH_COST = 16.0  # extra tokens a request that fails authentication costs its source
_SHUTDOWN_TIMEOUT_S = 2.0
# how long a served stream waits for the HTTP body's end behind the sender's END frame
BODY_END_WAIT_S = 1.0
_AUTH_KEY = web.RequestKey("swarm_auth", RequestAuth)


class Server:
    """A peer's aiohttp server: authenticates, bounds and routes every request.

    Args:
        identity, membership: who we are, who may talk to us.
        record: this peer's current signed record (served at ``/info``).
        max_chunk_bytes, max_stream_bytes: inbound frame and stream limits.
        replay_window_s: accepted clock difference.
        idle_timeout: seconds a connection may stay without a complete request.
        connections: the connection table (quotas, proofs, eviction).
        stream_limits: idle time, rate and partial-frame memory of inbound streams.
    """

    def __init__(
        self,
        identity: Identity,
        membership: Membership,
        *,
        record: Callable[[], PeerRecord],
        max_chunk_bytes: int,
        max_stream_bytes: int,
        replay_window_s: float,
        idle_timeout: float,
        connections: ConnectionLimits,
        stream_limits: StreamLimits,
    ):
        self.identity = identity
        self.membership = membership
        self._record = record
        self.max_chunk_bytes = max_chunk_bytes
        self.max_stream_bytes = max_stream_bytes
        self.idle_timeout = idle_timeout
        self.connections = connections
        self.stream_limits = stream_limits
        self.auth_work = HostBuckets(AUTH_RATE, AUTH_BURST)
        self._replay = ReplayGuard(replay_window_s)
        self._refusals = RateLimitedWarning(logger)
        self.streams: dict[str, StreamHandler] = {}
        self.metrics: Callable[[], bytes] | None = None  # serves GET /metrics when set
        self.refused: dict[str, int] = {}  # HTTP status -> requests refused with it
        self._runner: web.AppRunner | None = None

    async def start(self, listen: PeerAddress) -> int:
        """Bind ``listen``; returns the bound port.

        Raises:
            TransportError: the address cannot be bound.
        """
        # Authentication wraps each route rather than running as an aiohttp middleware: aiohttp
        # caches middleware chains per (handler, app) in a module-level LRU of 1024 entries,
        # which kept every closed server's app, and through it the whole peer, alive (a
        # process that replaced peers grew by a peer's state per replacement).
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_get("/ping", self._authenticated(self._handle_ping))
        app.router.add_get("/info", self._authenticated(self._handle_info))
        app.router.add_post("/stream/{name}", self._authenticated(self._handle_stream))
        app.router.add_get(METRICS_PATH, self._handle_metrics, allow_head=False)  # no swarm auth
        # anything else is authenticated first too, then refused as unknown
        app.router.add_route("*", "/{path:.*}", self._authenticated(self._handle_unknown))
        runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,  # a caller that hangs up cancels its handler
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            # armed as a connection opens: bounds the wait for request headers as well as the
            # idle time of a kept-alive connection (aiohttp's default is about an hour)
            keepalive_timeout=self.idle_timeout,
            # a body left unread (a refused request) closes the connection instead of being
            # read and discarded for up to 10 s
            lingering_time=0,
        )
        await runner.setup()
        if runner.server is None:
            raise TransportError("the HTTP server did not start")
        self.connections.guard(runner.server)
        try:
            await web.TCPSite(runner, listen.host, listen.port).start()
        except OSError as e:
            await runner.cleanup()
            raise TransportError(f"cannot listen on {listen}: {e}") from e
        self._runner = runner
        return int(runner.addresses[0][1])

    async def close(self) -> None:
        """Stop serving (handlers get a short grace period)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _authenticated(self, handler: _Handler) -> _Handler:
        """``handler`` behind :meth:`_authenticate`."""

        async def route(request: web.Request) -> web.StreamResponse:
            return await self._authenticate(request, handler)

        return route

    async def _authenticate(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        source = request.remote or "?"
        if not self.auth_work.take(source):
            return self._refuse(request, 429, AuthError("over the authentication budget"))
        try:
            auth = RequestAuth.decode(request.headers.get(AUTH_HEADER, ""))
            auth.verify(self.membership, method=request.method, path=request.path)
            if auth.target != self.identity.peer_id.digest and not (
                auth.target == b"" and request.path in PUBLIC_PATHS
            ):
                raise AuthError("request addressed to another peer")
            self._replay.check(auth.timestamp, auth.nonce, sender=auth.public_key)
        except AuthError as e:
            self.auth_work.penalize(source, FAILED_AUTH_COST)
            return self._refuse(request, 401, e)
        if not self.membership.admits(auth.public_key):
            self.auth_work.penalize(source, FAILED_AUTH_COST)
            return self._refuse(request, 403, AuthError("public key not on the allow-list"))
        request[_AUTH_KEY] = auth
        logger.debug("%s %s from %s (%s)", request.method, request.path, source, auth.cipher)
        with self.connections.request(request.protocol):
            response = await handler(request)
        if response.status < 400:
            self.connections.prove(source)
        return response

    def _refuse(self, request: web.Request, status: int, error: SwarmError) -> web.Response:
        source = request.remote or "?"
        self.refused[str(status)] = self.refused.get(str(status), 0) + 1
        self._refusals.warn(
            scope_of(source).subnet,
            "refused %s %s from %s: %s %s",
            request.method,
            request.path,
            source,
            status,
            error,
        )
        response = web.Response(status=status, text=str(error))
        # close instead of reading (or discarding) a body nobody will use
        response.force_close()
        return response

    async def _handle_unknown(self, request: web.Request) -> web.Response:
        known = (*PUBLIC_PATHS, METRICS_PATH)
        if request.path in known or request.path.startswith("/stream/"):
            return web.Response(status=405, text=f"{request.method} not allowed here")
        return web.Response(status=404, text="no such path")

    async def _handle_ping(self, request: web.Request) -> web.Response:
        return self._public_reply(request, b"pong")

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(status=404, text="metrics are off (enable them on the peer)")
        return web.Response(
            body=self.metrics(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def _handle_info(self, request: web.Request) -> web.Response:
        return self._public_reply(request, self._record().serialize())

    def _public_reply(self, request: web.Request, body: bytes) -> web.Response:
        """In a keyed swarm, an eavesdropper must not read our record: seal it for the caller."""
        auth = request[_AUTH_KEY]
        sealed = seal_reply(
            self.membership,
            caller=auth.public_key,
            request_nonce=auth.nonce,
            path=request.path,
            body=body,
        )
        return web.Response(body=sealed, content_type="application/octet-stream")

    async def _handle_stream(self, request: web.Request) -> web.StreamResponse:
        auth = request[_AUTH_KEY]
        name = request.match_info["name"]
        handler = self.streams.get(name)
        if handler is None:
            return web.Response(status=404, text=f"no stream {name!r}")
        sender = RemotePeer(
            PeerID.from_public_key(auth.public_key),
            auth.public_key,
            auth.agreement_key,
            request.remote or "",
        )
        try:
            aead = stream_aead(
                self.identity,
                self.membership,
                peer_public_key=auth.public_key,
                peer_agreement_key=auth.agreement_key,
                initiator=False,
                stream_id=auth.nonce,
                cipher=auth.cipher,
            )
        except ConfigError as e:
            return self._refuse(request, 400, e)
        except AuthError as e:
            return self._refuse(request, 401, e)
        label = f"{sender.peer_id.short}@{sender.host}"
        reader = FrameReader(
            request.content,
            Opener(aead, auth.nonce, TO_SERVER, max_frame_bytes=self.max_chunk_bytes),
            max_stream_bytes=self.max_stream_bytes,
            peer=label,
            limits=self.stream_limits,
            source=request.remote or "",
        )
        reply = ReplyStream(
            request, FrameWriter(Sealer(aead, auth.nonce, TO_CLIENT), self.max_chunk_bytes)
        )
        try:
            inbound = InboundStream(name, sender, await reader.read_header(), reader)
            await handler(inbound, reply)
        except (AuthError, TransportError) as e:
            status = 401 if isinstance(e, AuthError) else (e.status or 400)
            if isinstance(e, TransportError) and e.lost:
                # the sender died, hung up or gave up: nothing it sent was wrong
                logger.info("stream %s from %s ended early: %s", name, label, e)
                return self._ended(reply)
            if status == GONE:
                # this peer ended the exchange (its round is over, or it dropped a stalled
                # sender, which the round reports): DEBUG, as any authenticated peer can
                # reach it and the log must not grow with them
                logger.debug("stream %s from %s ended here: %s", name, label, e)
                if not reply.prepared:
                    response = web.Response(status=GONE, text=str(e))
                    response.force_close()  # its body is not read
                    return response
            elif not reply.prepared:
                return self._refuse(request, status, e)
            else:
                self._refusals.warn(
                    scope_of(request.remote or "?").subnet,
                    "stream %s from %s failed: %s",
                    name,
                    label,
                    e,
                )
            await reply.abort(e)
            return reply.response  # type: ignore[return-value]
        except Exception as e:  # the handler's own bug or failure: report it, never a short reply
            logger.warning("stream handler %r failed for %s: %r", name, label, e, exc_info=True)
            if not reply.prepared:
                return web.Response(status=500, text=f"handler failed: {type(e).__name__}")
            await reply.abort(e)
            return reply.response  # type: ignore[return-value]
        try:
            await reply.finish()
        except TransportError as e:  # the connection broke as the reply ended
            logger.info("stream %s from %s: the reply could not end: %s", name, label, e)
            return self._ended(reply)
        if reader.ended:
            await _body_end(request, BODY_END_WAIT_S)
        return reply.response  # type: ignore[return-value]

    @staticmethod
    def _ended(reply: ReplyStream) -> web.StreamResponse:
        """The response of a stream whose connection broke: nobody is left to read it."""
        if reply.response is None:
            response = web.Response(status=400, text="connection lost")
            response.force_close()
            return response
        reply.response.force_close()
        return reply.response


async def _body_end(request: web.Request, timeout: float) -> None:
    """Wait (at most ``timeout``) for the end of a request body whose END frame was read.

    aiohttp closes a kept-alive connection whose request body it has not seen end when the
    handler returns (we keep no lingering time), and the HTTP body's last bytes travel behind
    the END frame: a handler that answers at once (an RPC, the last member joining a group)
    can return before they arrive. The caller, holding a whole reply, puts the connection back
    in its pool; its next request there met the reset (an all-reduce part lost mid-round,
    whose owner then waited for it until its stall check gave up). Bytes after the END frame
    are a protocol violation: the connection is then closed as before.
    """
    content = request.content
    if content.is_eof():
        return
    try:
        extra = await asyncio.wait_for(content.read(1), timeout)
    except (asyncio.TimeoutError, OSError, aiohttp.ClientError, HttpProcessingError):
        return  # not reusable: aiohttp closes it
    if extra:
        logger.debug("bytes after a stream's END frame from %s", request.remote)
