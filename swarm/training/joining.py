"""Which state a late joiner adopts, and when it gives up deciding (the joiner's side).

The joiner asks up to ``MAX_MANIFESTS`` live peers for manifests (drawn at random, as likely as
their weight: :func:`~swarm.training.agreement.shares_of`); peers without a state
decline, and a decline counts nowhere. Malformed, oversized or absurd manifests are refused and
count nowhere either. :func:`~swarm.training.agreement.agree` keeps the providers in line with
the weighted majority; the joiner then downloads the state whose holders weigh most (split
across up to ``parts`` of them), verifies the SHA-256 of the whole, parses it against its own
model's layout, and checks that the values are finite and match the announced sketch. Nothing is
applied before every check passes. A provider whose state, once its hash checked out, fails a
check is proved wrong and not asked again.

Providers that disagree (a young swarm settles within seconds: peers that joined a moment ago
are adopting the state), a download that fails, or nobody offering while some peers decline:
the joiner asks again after ``ASK_WAIT_S``, then twice that, ``ASK_ATTEMPTS`` asks in all. Still
undecided, :func:`download_state` raises, and :func:`join_swarm` trains from the peer's own
weights (one WARNING says why): joining never fails for want of a state. Such a peer offers its
state to the next joiners only once it trained a round, so an undecided state does not spread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from swarm.address import PeerAddress
from swarm.config import SwarmConfig
from swarm.errors import SwarmError, TrainingError
from swarm.identity import PeerID
from swarm.net.record import PeerRecord
from swarm.protocols import Peer, StreamTransport
from swarm.training.agreement import (
    SKETCH_SLICES,
    Manifest,
    agree,
    shares_of,
    sketch_distance,
    sketch_of,
)
from swarm.training.engine import TrainingEngine
from swarm.training.snapshot import Snapshot, snapshot_size, unpack_snapshot
from swarm.training.transfer import ask_manifest, download_parts, subnet_of

logger = logging.getLogger(__name__)

JOIN_LOOKUPS = 5  # DHT reads while looking for live peers right after joining
MAX_MANIFESTS = 16  # providers asked at once, drawn among the live peers
ASK_ATTEMPTS = 3  # asks before a joiner gives up deciding
ASK_WAIT_S = 1.0  # wait before the second ask; it doubles before each later one


@dataclass(frozen=True)
class Joined:
    """What a late joiner adopted, and whom it refused."""

    snapshot: Snapshot
    steps_in_round: int  # the providers' phase in the round (the joiner aligns with it)
    providers: tuple[PeerID, ...]  # the state was downloaded from these
    refused: tuple[tuple[PeerID, str], ...]  # (provider, why) of every one not copied
    order: int | None = None  # the median round order of the agreeing providers (None: unknown)


class _Refuted(TrainingError):
    """What arrived, under the hash its providers announced, proves every one of them wrong."""


@dataclass
class _Ask:
    """The answers to one ask."""

    manifests: list[Manifest]  # well-formed offers of a fitting size
    refused: list[tuple[PeerID, str]]  # (provider, why) of malformed or oversized offers
    declined: int  # peers that have no state to offer yet


def draw(records: Sequence[PeerRecord], count: int) -> list[PeerRecord]:
    """``count`` records drawn without replacement, each as likely as its provider weight
    (:func:`~swarm.training.agreement.shares_of`: identities crowding one subnet are drawn
    about as often as one), by Efraimidis-Spirakis: the largest ``u ** (1 / w)``."""
    rng = random.SystemRandom()
    shares = shares_of([(i, r.age_s, subnet_of(r)) for i, r in enumerate(records)])
    keyed = [(math.log(rng.random() or 1e-300) / shares[i], i) for i in range(len(records))]
    return [records[i] for _, i in sorted(keyed, reverse=True)[:count]]


async def _ask(
    transport: StreamTransport,
    records: Sequence[PeerRecord],
    schema: str,
    bound: int,
    timeout: float,
) -> _Ask:
    asked = draw(records, MAX_MANIFESTS)
    answers = await asyncio.gather(
        *(ask_manifest(transport, r, schema, timeout) for r in asked), return_exceptions=True
    )
    out = _Ask([], [], 0)
    for record, answer in zip(asked, answers, strict=True):
        if isinstance(answer, Manifest) and answer.size <= bound:
            out.manifests.append(answer)
        elif isinstance(answer, Manifest):
            out.refused.append((record.peer_id, f"offers {answer.size} bytes, over {bound}"))
        elif answer is None:
            out.declined += 1
        elif isinstance(answer, TrainingError):
            out.refused.append((record.peer_id, str(answer)))
        elif isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        else:
            logger.debug("no state from %s: %s", record.peer_id.short, answer)
    return out


async def _fetch(
    transport: StreamTransport, group: Sequence[Manifest], engine: TrainingEngine, timeout: float
) -> Snapshot:
    """Download the state ``group`` holds and check it (raises :class:`_Refuted` on proof)."""
    m = group[0]
    blob = await download_parts(transport, group, engine.schema, timeout)
    digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
    if digest != m.sha256:
        # parts from several providers: one of them broke it, which one is unknown
        fail = _Refuted if len(group) == 1 else TrainingError
        raise fail("the assembled state fails its checksum")
    try:
        snap = unpack_snapshot(blob, schema=engine.schema, expected=engine.snapshot_layout())
    except TrainingError as e:
        raise _Refuted(str(e)) from e
    if snap.round != m.round:
        raise _Refuted(f"the snapshot claims round {snap.round}, not {m.round}")
    if not await asyncio.to_thread(snap.all_finite):
        raise _Refuted("the state holds NaN or Inf values")
    sketch = await asyncio.to_thread(sketch_of, snap.values)
    if sketch_distance(sketch, m.sketch) > 1e-5:
        raise _Refuted("the state does not match the sketch its providers announced")
    return snap


async def download_state(
    transport: StreamTransport,
    records: Sequence[PeerRecord],
    engine: TrainingEngine,
    *,
    parts: int,
    max_bytes: int,
    timeout: float,
    refresh: Callable[[], Awaitable[Sequence[PeerRecord]]] | None = None,
    attempts: int = ASK_ATTEMPTS,
    wait_s: float = ASK_WAIT_S,
) -> Joined | None:
    """Download, verify and parse the state that the weighted majority of providers agree on.

    Args:
        records: the live peers (PeerRecords) other than this one.
        refresh: reads the live peers again before each later ask (None: keep ``records``).

    Returns:
        What was adopted, or None when no peer offers a state (this is the first training peer).

    Raises:
        TrainingError: after ``attempts`` asks, still no weighted majority of the valid offers
            agree, or no complete, verified state could be assembled from those that do; the
            message says why.
    """
    layout = engine.snapshot_layout()
    bound = min(max_bytes, snapshot_size(layout, schema=engine.schema, mode=engine.config.mode))
    sketch_len = min(SKETCH_SLICES, sum(n for _, n in layout))
    refuted: dict[PeerID, str] = {}  # provider -> why: proved wrong, asked no more
    why = "no provider offers a state"
    offered = False  # some peer offered a state, even a broken one
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(wait_s * 2 ** (attempt - 1))
            if refresh is not None:
                try:
                    records = list(await refresh())
                except SwarmError as e:
                    logger.debug("reading the live peers again failed: %s", e)
        pool = [r for r in records if r.peer_id not in refuted]
        if not pool:
            break
        ask = await _ask(transport, pool, engine.schema, bound, timeout)
        offered = offered or bool(ask.manifests or ask.refused)
        verdict = agree(ask.manifests, sketch_len=sketch_len)
        logger.debug(
            "ask %d: %s",
            attempt + 1,
            ", ".join(
                f"{m.provider.peer_id.short} r{m.round} {m.subnet} {m.age_s:.3g}s "
                f"w{verdict.shares[m.provider_id]:.3g}"
                for m in ask.manifests
            ),
        )
        refused = ask.refused + [(m.provider.peer_id, r) for m, r in verdict.refused]
        if not verdict.majority:
            if not offered and not ask.declined:
                return None  # nobody here trains: this peer is the first
            if ask.manifests or ask.refused:
                why = (
                    "no weighted majority of state providers agree (weight "
                    f"{verdict.weight:.3g} of {verdict.total:.3g} in line; {len(ask.manifests)} "
                    "valid offers, "
                    f"{len(ask.refused)} broken, {ask.declined} declined)"
                )
                why += "".join(f"; {pid.short}: {r}" for pid, r in refused)
            logger.info("%s; asking again", why)
            continue
        for group in verdict.candidates():
            group = group[:parts]
            try:
                snap = await _fetch(transport, group, engine, timeout)
            except TrainingError as e:
                why = f"the state of round {group[0].round} failed: {e}"
                logger.info("%s", why)
                refused += [(x.provider.peer_id, str(e)) for x in group]
                if isinstance(e, _Refuted):
                    refuted.update((x.provider.peer_id, str(e)) for x in group)
                continue
            return _joined(snap, group, verdict.accepted, refused, refuted)
    if not offered:
        return None
    raise TrainingError(why)


def _joined(
    snap: Snapshot,
    group: Sequence[Manifest],
    accepted: Sequence[Manifest],
    refused: list[tuple[PeerID, str]],
    refuted: dict[PeerID, str],
) -> Joined:
    every = dict(refused)
    for pid, why in refuted.items():
        every.setdefault(pid, why)
    for pid, why in every.items():
        logger.warning("state provider %s refused: %s", pid.short, why)
    logger.info(
        "adopted round %d's state from %d peers (%d providers agreed, %d refused)",
        snap.round,
        len(group),
        len(accepted),
        len(every),
    )
    orders = [m.order for m in accepted if m.order is not None]
    return Joined(
        snap,
        max(x.steps_in_round for x in group),
        tuple(x.provider.peer_id for x in group),
        tuple(every.items()),
        int(statistics.median_low(orders)) if orders else None,
    )


async def initial_records(peer: Peer, config: SwarmConfig) -> list[PeerRecord]:
    """The signed records of the initial peers, asked directly: the peers the user named are
    always heard, even when the DHT's listing right after joining shows only others. They
    weigh like any provider (their DHT age, when the listing has them, is kept instead)."""
    found = []
    for text in config.peer.initial_peers:
        try:
            address = PeerAddress.parse(text)
            record = await peer.transport.fetch_info(
                address, timeout=config.peer.dht_request_timeout_s
            )
        except (SwarmError, OSError, asyncio.TimeoutError) as e:
            logger.debug("no record from the initial peer %s: %s", text, e)
            continue
        if record.run_id == config.peer.run_id and not record.left:
            found.append(record)
    return found


async def join_swarm(peer: Peer, engine: TrainingEngine, config: SwarmConfig) -> Joined | None:
    """Adopt the state the live peers agree on into ``engine``, or train its own.

    Args:
        peer: the joining :class:`~swarm.peer.Peer` (its DHT and transport are up).
        config: the :class:`~swarm.config.SwarmConfig` (``state_*`` fields).

    Returns:
        What was adopted, or None when this peer trains from its own weights: nobody offers a
        state, or no decision was possible (one WARNING says why). Never raises for want of one.
    """

    async def others() -> list[PeerRecord]:
        try:
            live = dict(await peer.known_peers())
        except SwarmError as e:
            logger.debug("reading the live peers failed: %s", e)
            live = {}
        for record in await initial_records(peer, config):
            live.setdefault(record.peer_id, record)
        return [r for pid, r in live.items() if pid != peer.peer_id]

    for lookup in range(JOIN_LOOKUPS):
        records = await others()
        if records:
            break
        await asyncio.sleep(0.2 * (lookup + 1))
    try:
        got = (
            await download_state(
                peer.transport,
                records,
                engine,
                parts=config.state_parts,
                max_bytes=config.max_state_bytes,
                timeout=config.state_timeout_s,
                refresh=others,
            )
            if records
            else None
        )
    except TrainingError as e:
        got = None
        logger.warning(
            "could not decide which state to adopt (%s): training from this peer's own weights; "
            "it averages in with the swarm later",
            e,
        )
    else:
        if got is None:
            logger.warning(
                "no peer offers a training state (%d known): starting from this peer's weights",
                len(records),
            )
    if got is None:
        engine.offer_from_round = engine.round + 1
        return None
    await asyncio.to_thread(engine.load_snapshot, got.snapshot, got.steps_in_round)
    logger.info("joined at round %d", engine.round)
    return got
