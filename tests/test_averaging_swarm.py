"""Group averaging on loopback: exact means, codec error bounds, a SIGKILLed member, hostile
streams, concurrent groups and a bandwidth-0 member.

The first tests run each peer as its own process (tests/averaging_worker.py) on its own loopback
address; the hostile-stream and grouping tests run several peers on one event loop (real sockets,
real transport) because they inject requests through the transport and stream API directly.
Every check is made against what :class:`~swarm.averaging.RoundResult` says was applied: part
``j`` equals the weighted mean over the peers listed in ``parts[j]``, a missing part keeps this
peer's own values.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import struct
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from loopback_peers import fixed_group_config, start_peers
from processes import OutputProcess

from swarm.auth import AUTH_HEADER, RequestAuth, derive_stream_key
from swarm.averaging import Averager, AveragingConfig, Fault, PartPlan, RoundResult
from swarm.averaging.groups.group import GroupInfo
from swarm.averaging.groups.matchmaking import Matchmaker
from swarm.errors import TransportError
from swarm.net import wire
from swarm.net.frames import DATA, END, ERROR, HEADER, PREFIX_BYTES, TO_SERVER, Sealer, make_aead
from swarm.peer import Peer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = [sys.executable, str(HERE / "averaging_worker.py")]


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("averaging_worker", HERE / "averaging_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tensor = _load_worker_module().make_tensor


# ---- worker processes


class Worker(OutputProcess):
    """An averaging_worker process."""

    def __init__(self, seed: int, weight: float, *args: str):
        self.seed, self.weight = seed, weight
        super().__init__([*WORKER, "--seed", str(seed), "--weight", str(weight), *args])


@pytest.fixture
def swarm_of(tmp_path):
    """``swarm_of(n, *args, weights=..., extra={rank: args})``: n workers, rank 0 first."""
    started: list[Worker] = []

    def start(
        n: int,
        *args: str,
        weights: Sequence[float] | None = None,
        extra: dict[int, Sequence[str]] | None = None,
    ) -> list[Worker]:
        weights = weights or [1.0] * n
        common = ["--wait-peers", str(n), "--min-group", str(n), "--target-group", str(n), *args]
        workers: list[Worker] = []
        address = ""
        for rank in range(n):
            own = [
                "--listen",
                f"127.0.0.{20 + rank}:0",
                "--out",
                str(tmp_path / f"peer{rank}.pt"),
                *(extra or {}).get(rank, ()),
            ]
            if workers:
                own += ["--initial-peers", address]
            w = Worker(rank + 1, weights[rank], *common, *own)
            started.append(w)
            workers.append(w)
            if rank == 0:
                address = w.wait_for(r"^ADDRESS (\S+)")[1]
        return workers

    yield start
    for w in started:
        w.kill()
    for rank, w in enumerate(started):  # shown when the test failed (pytest's captured output)
        print(f"---- worker {rank}", *w.lines, sep="\n")


def expected_result(report: dict, values: dict[str, tuple[torch.Tensor, float]]) -> torch.Tensor:
    """What ``report`` says this peer applied: the weighted mean per averaged part, its own
    values elsewhere. ``values``: peer id -> (original tensor, weight)."""
    out = values[report["me"]][0].clone()
    for part, ids in report["parts"].items():
        start, end = report["ranges"][int(part)]
        total = sum(values[i][1] for i in ids)
        acc = sum(values[i][1] * values[i][0][start:end].double() for i in ids)
        out[start:end] = (acc / total).float()
    return out


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def error_by_slice(got: torch.Tensor, want: torch.Tensor, slices: int = 8) -> list[float]:
    """:func:`rel_error` over each of ``slices`` equal slices (where a wrong average lies)."""
    pairs = zip(got.chunk(slices), want.chunk(slices), strict=True)
    return [round(rel_error(g, w), 4) for g, w in pairs]


def originals(workers: Sequence[Worker], numel: int) -> dict[str, tuple[torch.Tensor, float]]:
    return {w.wait_for(r"^ID (\S+)")[1]: (make_tensor(w.seed, numel), w.weight) for w in workers}


# ---- processes: exact mean, codecs, a killed member


@pytest.mark.slow
def test_four_peers_exact_weighted_mean_10m(swarm_of, tmp_path) -> None:
    numel = 10_000_000
    workers = swarm_of(4, "--numel", str(numel), weights=[1.0, 2.0, 3.0, 0.5])
    for w in workers:
        w.wait_for("^DONE", 90)
    values = originals(workers, numel)
    want = sum(w * x.double() for x, w in values.values()) / sum(w for _, w in values.values())
    members = None
    for rank, w in enumerate(workers):
        (report,) = w.rounds()
        assert report["averaged"] and not report["reason"], report
        assert len(report["parts"]) == 4 and all(len(p) == 4 for p in report["parts"].values())
        members = members or report["members"]
        assert report["members"] == members  # one agreed, ordered group
        got = torch.load(tmp_path / f"peer{rank}.pt")["none"]["last"]
        assert got.dtype == torch.float32 and got.shape == (numel,)
        diff = (got.double() - want).abs()
        assert float((diff / want.abs().clamp_min(1e-3)).max()) <= 1e-6 or float(
            diff.max()
        ) <= 1e-6 * float(want.abs().max())
        assert rel_error(got, want) <= 1e-6


# per-codec bound of one round's relative L2 error against the exact mean with 4 peers (measured:
# int8 0.005, topk:0.1 0.92, 1bit 0.22; the owner's own share is exact, so topk stays below 1)
CODEC_BOUNDS = {"int8": 0.01, "topk:0.1": 0.96, "1bit": 0.3}


@pytest.mark.slow
def test_lossy_codecs_within_bounds_and_feedback_converges(swarm_of, tmp_path) -> None:
    numel, rounds = 1 << 20, 8
    workers = swarm_of(
        4,
        *("--numel", str(numel), "--rounds", str(rounds), "--gather-window", "0.05"),
        *("--codecs", *CODEC_BOUNDS),
        weights=[1.0, 3.0, 2.0, 1.0],
    )
    for w in workers:
        w.wait_for("^DONE", 90)
    values = originals(workers, numel)
    want = sum(w * x.double() for x, w in values.values()) / sum(w for _, w in values.values())
    for rank, w in enumerate(workers):
        saved = torch.load(tmp_path / f"peer{rank}.pt")
        for codec, bound in CODEC_BOUNDS.items():
            reports = [r for r in w.rounds() if r["codec"] == codec]
            assert len(reports) == rounds and all(r["averaged"] for r in reports), reports
            assert all(len(p) == 4 for r in reports for p in r["parts"].values())
            first = rel_error(saved[codec]["first"], want)
            mean = rel_error(saved[codec]["mean"], want)
            assert torch.isfinite(saved[codec]["last"]).all()
            assert first <= bound, (codec, first, error_by_slice(saved[codec]["first"], want))
            # error feedback: what one round loses is sent in later rounds, so the running mean
            # of the results approaches the exact mean (measured: int8 8x, 1bit and topk 1.4x
            # closer after 8 rounds)
            assert mean <= (first / 4 if codec == "int8" else 0.85 * first), (codec, first, mean)
        if rank:  # owners apply what they send: every member ends each round with the same values
            first_peer = torch.load(tmp_path / "peer0.pt")
            for codec in CODEC_BOUNDS:
                assert torch.equal(saved[codec]["last"], first_peer[codec]["last"]), codec


@pytest.mark.slow
def test_sigkill_mid_stream_the_others_finish(swarm_of, tmp_path) -> None:
    numel, timeout = 4 << 20, 20.0
    workers = swarm_of(
        4,
        *("--numel", str(numel), "--allreduce-timeout", str(timeout)),
        weights=[1.0, 2.0, 3.0, 4.0],
        extra={3: ["--fault", "stall"]},  # stops halfway through every part it sends
    )
    victim, survivors = workers[3], workers[:3]
    victim.wait_for("^STALLED", 60)
    victim.kill()
    killed_at = time.monotonic()
    for w in survivors:
        w.wait_for("^DONE", 60)
    finished_in = time.monotonic() - killed_at
    values = originals(workers, numel)
    dead = victim.wait_for(r"^ID (\S+)")[1]
    for rank, w in enumerate(survivors):
        (report,) = w.rounds()
        assert report["averaged"], report
        assert report["allreduce_s"] < timeout and finished_in < timeout, (report, finished_in)
        owners = report["members"]
        for part, ids in report["parts"].items():
            if owners[int(part)] != dead:  # a live owner never counts a half-sent part
                assert dead not in ids and len(ids) == 3, report
        got = torch.load(tmp_path / f"peer{rank}.pt")["none"]["last"]
        assert torch.isfinite(got).all()
        assert rel_error(got, expected_result(report, values)) <= 1e-6


# ---- in-process peers: hostile streams, concurrent groups, a bandwidth-0 member


def averager(peer: Peer, n: int, key: str = "test", target: int | None = None) -> Averager:
    return Averager(
        peer,
        AveragingConfig(
            codec="none",
            min_group_size=min(n, target or n),
            target_group_size=target or n,
            matchmaking_timeout_s=8.0,
            round_timeout_s=28.0,
            gather_window_s=0.1,
            group_key=key,
            grouping="fixed",
            threads=1,
            aggregator="mean",  # these tests check exact weighted means
        ),
    )


def check_applied(
    result: RoundResult,
    got: torch.Tensor,
    values: dict[Any, tuple[torch.Tensor, float]],
    me: Any,
    ranges: Sequence[tuple[int, int]],
) -> None:
    """``got`` holds the weighted mean over ``parts[j]`` in every part j, our values elsewhere."""
    want = values[me][0].clone()
    for part, ids in result.parts.items():
        start, end = ranges[part]
        total = sum(values[i][1] for i in ids)
        want[start:end] = (sum(values[i][1] * values[i][0][start:end] for i in ids) / total).float()
    assert torch.isfinite(got).all()
    assert rel_error(got, want) <= 1e-6, (result, rel_error(got, want))


def sealed_request(
    sender: Peer, owner: Any, header: dict[str, Any], frames: list[tuple[int, bytes]]
) -> tuple[dict[str, str], list[bytes]]:
    """Auth headers and the sealed frames (one bytes per frame) of a stream ``sender`` -> owner."""
    path = "/stream/avg.part"
    auth = RequestAuth.create(
        sender.identity,
        sender.config.membership,
        target=owner.peer_id.digest,
        method="POST",
        path=path,
        cipher="aes-256-gcm",
    )
    key = derive_stream_key(
        sender.identity,
        sender.config.membership,
        peer_public_key=owner.public_key,
        peer_agreement_key=owner.agreement_key,
        initiator=True,
        stream_id=auth.nonce,
        cipher=auth.cipher,
    )
    sealer = Sealer(make_aead(auth.cipher, key), auth.nonce, TO_SERVER)
    sealed = [b"".join(sealer.seal(kind, data)) for kind, data in frames]
    return {AUTH_HEADER: auth.encode()}, sealed


class HostileMember:
    """Replaces one member's part streams with hand-made requests (through its transport).

    To ``modes[owner id]``: ``tamper`` flips a byte of the second chunk, ``replay-chunk`` sends
    the first chunk's frame twice, ``replay-request`` sends an honest stream, then the same
    request again. Each stream then fails on the member's side (it keeps its own values). An
    ``outsider`` peer also opens a part stream of this group before the first hostile stream.
    """

    def __init__(self, peer: Peer, modes: dict[Any, str], outsider: Peer):
        self.peer, self.modes, self.outsider = peer, modes, outsider
        self.statuses: dict[str, list[int | str]] = {}
        self._stream = peer.transport.stream
        peer.transport.stream = self.stream  # type: ignore[method-assign]

    def stream(self, owner, name, header, chunks, *, timeout):
        if name != "avg.part":
            return self._stream(owner, name, header, chunks, timeout=timeout)
        return _Injected(self, owner, header, chunks)

    async def post(self, session, owner, headers: dict[str, str], body: bytes) -> int | str:
        url = owner.address.url + "/stream/avg.part"
        try:
            async with session.post(url, headers=headers, data=body) as r:
                reply = await r.read()
        except aiohttp.ClientError as e:  # the server may cut an upload it refused
            return type(e).__name__
        if r.status != 200:
            return r.status
        # an accepted stream may still fail later: the reply then ends with an ERROR frame
        kinds, at = [], 0
        while at + PREFIX_BYTES <= len(reply):
            length, kind = struct.unpack(">IB", reply[at : at + PREFIX_BYTES])
            kinds.append(kind)
            at += PREFIX_BYTES + length
        return "aborted" if kinds and kinds[-1] == ERROR else 200

    async def attack(self, owner, header: dict[str, Any], payloads: list[bytes]) -> None:
        mode = self.modes[owner.peer_id]
        if "outsider" not in self.statuses:
            self.statuses["outsider"] = [await self.intrude(owner, header)]
        frames = [(HEADER, wire.pack(header)), *((DATA, p) for p in payloads), (END, b"")]
        headers, sealed = sealed_request(self.peer, owner, header, frames)
        if mode == "tamper":
            frame = bytearray(sealed[2])
            frame[len(frame) // 2] ^= 0x40
            sealed[2] = bytes(frame)
        elif mode == "replay-chunk":
            sealed.insert(2, sealed[1])
        async with aiohttp.ClientSession() as session:
            statuses = [await self.post(session, owner, headers, b"".join(sealed))]
            if mode == "replay-request":
                statuses.append(await self.post(session, owner, headers, b"".join(sealed)))
        self.statuses[mode] = statuses

    async def intrude(self, owner, header: dict[str, Any]) -> int | str:
        async def nothing() -> AsyncIterator[bytes]:
            return
            yield b""

        try:
            async with self.outsider.transport.stream(
                owner, "avg.part", header, nothing(), timeout=10
            ):
                return 200
        except TransportError as e:
            return e.status or str(e)


class _Injected:
    def __init__(self, member: HostileMember, owner, header, chunks):
        self.member, self.owner, self.header, self.chunks = member, owner, header, chunks

    async def __aenter__(self):
        payloads = [p async for p in self.chunks]
        await self.member.attack(self.owner, self.header, payloads)
        raise TransportError("hostile stream sent", status=499)

    async def __aexit__(self, *exc_info: object) -> None:
        return None


@pytest.mark.timeout(60)
async def test_tampered_replayed_and_outsider_streams_refused() -> None:
    numel = 4 * 600_000  # parts of 3 chunks
    peers = await start_peers([41, 42, 43, 44, 45])
    members, outsider = peers[:4], peers[4]
    averagers = [averager(p, 4) for p in members]
    try:
        honest, hostile = members[:3], members[3]
        modes = dict(
            zip(
                (p.peer_id for p in honest),
                ["tamper", "replay-chunk", "replay-request"],
                strict=True,
            )
        )
        injector = HostileMember(hostile, modes, outsider)
        values = {
            p.peer_id: (make_tensor(i + 1, numel), float(i + 1)) for i, p in enumerate(members)
        }
        tensors = [values[p.peer_id][0].clone() for p in members]
        results = await asyncio.gather(
            *(
                a.average([t], weight=values[p.peer_id][1])
                for a, t, p in zip(averagers, tensors, members, strict=True)
            )
        )
        assert injector.statuses["outsider"] == [401], injector.statuses
        refused = (401, "aborted", "ClientOSError", "ServerDisconnectedError")
        assert injector.statuses["tamper"][0] in refused, injector.statuses
        assert injector.statuses["replay-chunk"][0] in refused, injector.statuses
        assert injector.statuses["replay-request"][0] == 200
        assert injector.statuses["replay-request"][1] in (401, "ClientOSError"), injector.statuses
        order = results[0].members
        ranges = [tuple(r) for r in PartPlan.create(numel, [1.0] * 4, 1).ranges]
        for peer, result, got in zip(members, results, tensors, strict=True):
            assert result.averaged and result.members == order, result
            check_applied(result, got, values, peer.peer_id, ranges)
        for peer, result in zip(honest, results[:3], strict=True):
            own = order.index(peer.peer_id)
            expected = set(order) - (
                {hostile.peer_id} if modes[peer.peer_id] != "replay-request" else set()
            )
            assert set(result.parts[own]) == expected, (modes[peer.peer_id], result)
            assert outsider.peer_id not in {i for ids in result.parts.values() for i in ids}
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(60)
async def test_concurrent_groups_never_mix_and_a_bandwidth_zero_member_takes_part() -> None:
    numel = 1 << 20
    # group x: three peers, one with bandwidth 0 (owns no part); group y: two peers
    peers = await start_peers([51, 52, 53, 54, 55], bandwidths=[1e6, 0.0, 1e6, 1e6, 1e6])
    keys = ["x", "x", "x", "y", "y"]
    averagers = [averager(p, keys.count(k), key=k) for p, k in zip(peers, keys, strict=True)]
    try:
        values = {p.peer_id: (make_tensor(i + 1, numel), float(i + 2)) for i, p in enumerate(peers)}
        tensors = [values[p.peer_id][0].clone() for p in peers]
        results = await asyncio.gather(
            *(
                a.average([t], weight=values[p.peer_id][1])
                for a, t, p in zip(averagers, tensors, peers, strict=True)
            )
        )
        groups = {
            k: {p.peer_id for p, kk in zip(peers, keys, strict=True) if kk == k} for k in "xy"
        }
        assert results[0].group_id != results[3].group_id
        for key, result, got in zip(keys, results, tensors, strict=True):
            assert result.averaged and set(result.members) == groups[key], result
            ids = groups[key]
            want = sum(values[i][1] * values[i][0].double() for i in ids)
            want = want / sum(values[i][1] for i in ids)
            assert rel_error(got, want) <= 1e-6, (key, rel_error(got, want))
        zero = results[1]
        assert len(zero.parts) == 2 and zero.members.index(peers[1].peer_id) not in zero.parts
        assert all(set(ids) == groups["x"] for ids in zero.parts.values())
        assert zero.bytes_sent > 0 and zero.bytes_received > 0
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


class StaleViewMatchmaker(Matchmaker):
    """Does not see ``hidden`` peers' declarations until ``until`` (monotonic): a DHT read
    that missed them, as happens to a late peer or right after a store."""

    def __init__(self, peer: Peer, hidden: set, until: float, **kwargs: Any):
        super().__init__(peer, **kwargs)
        self.hidden, self.until = hidden, until

    async def _candidates(self, rnd: Any) -> dict:
        view = await super()._candidates(rnd)
        if time.monotonic() < self.until:
            view = {p: d for p, d in view.items() if p not in self.hidden}
        return view


async def test_leaders_of_a_split_merge_into_one_group() -> None:
    peers = await start_peers([61, 62, 63, 64])
    peers.sort(key=lambda p: p.peer_id.digest)
    low, high = {p.peer_id for p in peers[:2]}, {p.peer_id for p in peers[2:]}
    until = time.monotonic() + 1.5
    makers = [
        StaleViewMatchmaker(
            p,
            high if p.peer_id in low else low,
            until,
            rpc_name="mm.join",
            min_group_size=2,
            target_group_size=4,
            gather_window=0.1,
        )
        for p in peers
    ]
    try:
        # each half sees only itself at first: peers[0] and peers[2] both start leading a pair
        groups = await asyncio.gather(
            *(m.form_group("split-test", 8.0, expected=4, patience=4.0) for m in makers)
        )
        assert all(isinstance(g, GroupInfo) for g in groups), groups
        assert {g.group_id for g in groups} == {groups[0].group_id}
        assert set(groups[0].peer_ids) == low | high
    finally:
        for m in makers:
            await m.close()
        await asyncio.gather(*(p.close() for p in peers))


# once, in a suite beside the churn test's processes, a member of the fallback round formed no
# group (not reproduced in 14 runs alone or beside three busy loops); the message says why
@pytest.mark.flaky(reruns=1)
async def test_planned_leader_is_joined_directly_and_a_wrong_plan_falls_back() -> None:
    peers = await start_peers([71, 72, 73, 74])
    peers.sort(key=lambda p: p.peer_id.digest)
    makers = [
        Matchmaker(p, rpc_name="mm.join", min_group_size=2, target_group_size=4, gather_window=0.3)
        for p in peers
    ]
    try:
        leader = peers[0].transport.record()
        planned = await asyncio.gather(
            *(m.form_group("planned", 8.0, expected=4, leader=leader) for m in makers)
        )
        assert all(isinstance(g, GroupInfo) for g in planned), planned
        assert {g.group_id for g in planned} == {planned[0].group_id}
        # a plan naming a peer that does not look for this key: the DHT path still groups
        # (with the patience the averager gives, so that the leader waits for all three even
        # when one member's DHT reads are late on a loaded machine)
        absent = peers[3].transport.record()
        fallback = await asyncio.gather(
            *(
                m.form_group("fallback", 8.0, expected=3, patience=4.0, leader=absent)
                for m in makers[:3]
            )
        )
        assert all(isinstance(g, GroupInfo) for g in fallback), [
            str(g) if not isinstance(g, GroupInfo) else len(g.peer_ids) for g in fallback
        ]
        assert set(fallback[0].peer_ids) == {p.peer_id for p in peers[:3]}
    finally:
        for m in makers:
            await m.close()
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_group_brings_its_members_round_orders_and_synced_tensors_together() -> None:
    """Members that disagree on the round order (a restarted peer, one that ran ahead) leave
    a group with the second largest their streams claimed, which a member claiming far ahead
    cannot move; a group that syncs averages the extra tensors too."""
    peers = await start_peers([71, 72, 73])
    avgs = [averager(p, 3, key="order") for p in peers]
    try:
        for a, order in zip(avgs, (0, 5, 17), strict=True):
            a.planner.order = order
        values = [torch.full((64,), float(i)) for i in range(3)]
        anchors = [torch.full((32,), 10.0 * i) for i in range(3)]
        results = await asyncio.gather(
            *(
                a.average([v], weight=1.0, sync=[s], sync_every=1)
                for a, v, s in zip(avgs, values, anchors, strict=True)
            )
        )
        assert all(r.averaged and r.synced for r in results), results
        assert [a.planner.order for a in avgs] == [6, 6, 6]
        for v, s in zip(values, anchors, strict=True):
            torch.testing.assert_close(v, torch.full((64,), 1.0))
            torch.testing.assert_close(s, torch.full((32,), 10.0))
        avgs[2].faults.fault = Fault.ORDER_AHEAD  # claims ORDER_SLACK ahead in its streams
        results = await asyncio.gather(
            *(a.average([v], weight=1.0) for a, v in zip(avgs, values, strict=True))
        )
        assert all(r.averaged for r in results) and avgs[2].fault_triggered.is_set(), results
        assert [a.planner.order for a in avgs] == [7, 7, 7]
    finally:
        await asyncio.gather(*(a.close() for a in avgs))
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_member_alone_in_a_repair_does_not_wait_for_members_that_settled_the_round():
    """One owner breaks its reply to one member only (a connection lost at the verdict): that
    member alone plans a repair of the part. The third member settled the round without one:
    it answers the repair's streams at once (they name the round they repair), and the lone
    member's repair drops it for that reason, not after a stall limit or the deadline."""
    peers = await start_peers([111, 112, 113])
    config = fixed_group_config(3, "lone-repair", stall_timeout_min_s=5.0, aggregator="mean")
    faults = [Fault.NONE, Fault.NONE, Fault.CUT_ONE_REPLY]
    avgs = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        inputs = (0.0, 1.0, 5.0)  # mean 2, equal to no input
        values = [torch.full((30_000,), x) for x in inputs]
        results = await asyncio.gather(*(a.average([v]) for a, v in zip(avgs, values, strict=True)))
        assert avgs[2].faults.triggered.is_set()
        lone = [i for i, r in enumerate(results) if len(r.parts) < 3]
        assert len(lone) == 1 and lone[0] != 2, results
        other = 1 - lone[0]
        assert len(results[other].parts) == 3 and len(results[2].parts) == 3, results
        mine = results[lone[0]]
        assert "kept local values" in mine.reason, mine
        why = {r.peer: r.why for r in mine.refusals if r.action == "dropped"}
        assert "the group is over there" in why[peers[other].peer_id], mine.refusals
        # the part that failed kept this member's own values, the others hold the mean
        got = values[lone[0]]
        kept = int((got == inputs[lone[0]]).sum())
        assert 0 < kept < got.numel() and int((got == 2.0).sum()) == got.numel() - kept
        # the parent a repair stream names is checked like the rest of its header
        owner = peers[other].transport.record()
        base = {"g": bytes(16), "p": 0, "a": 0, "w": 1.0}
        for parent, status in (("text", 400), (b"short", 400), (results[other].group_id, 404)):
            with pytest.raises(TransportError) as refused:
                async with peers[2].transport.stream(
                    owner, "avg.part", {**base, "r": parent}, _nothing(), timeout=10
                ):
                    pass
            assert refused.value.status == status, (parent, refused.value)
    finally:
        await asyncio.gather(*(a.close() for a in avgs))
        await asyncio.gather(*(p.close() for p in peers))


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


def _count_chunk_rows(monkeypatch) -> list[int]:
    """The number of chunks holding rows at every owner, each time one takes a chunk's rows."""
    from swarm.averaging.butterfly.reducer import PartReducer

    most: list[int] = []
    chunk_rows = PartReducer._chunk_rows

    def counted(self: PartReducer, index: int) -> torch.Tensor:
        rows = chunk_rows(self, index)
        most.append(len(self._rows))
        return rows

    monkeypatch.setattr(PartReducer, "_chunk_rows", counted)
    return most


@pytest.mark.timeout(90)
async def test_a_tainted_part_keeps_no_rows_for_the_rest_of_its_streams(
    monkeypatch, caplog
) -> None:
    """A sender that stalls halfway taints the part once dropped; the attempt is over, so the
    other senders' remaining chunks are checked in a scratch row and kept nowhere (the window
    no longer holds them back: before, they filled rows for the rest of the part, 19 chunks'
    worth here), and the retry reuses the rows the tainted attempt left. The drop is logged
    at INFO by the owner only (its server ends the stream with 410, at DEBUG), as a slow
    honest link meets it too
    (the server logged the stream's end at WARNING before)."""
    from swarm.averaging.butterfly.intake import WINDOW_CHUNKS

    most = _count_chunk_rows(monkeypatch)
    n, numel = 4, 32 << 20  # 32 chunks of 1 MiB per part; the staller stops after 16
    peers = await start_peers([121, 122, 123, 124])
    config = fixed_group_config(n, "tainted", aggregator="centered_clip")
    faults = [Fault.NONE] * (n - 1) + [Fault.STALL_MID_STREAM]
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        tensors = [make_tensor(i + 1, numel) for i in range(n)]
        caplog.set_level(logging.DEBUG, logger="swarm.net.server")
        results = await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )
        honest_ids = {p.peer_id for p in peers[:-1]}
        for result in results[:-1]:  # every part averages the honest members (after a retry)
            assert result.averaged and len(result.parts) == n, result
            assert all(honest_ids <= set(m) for m in result.parts.values()), result
        assert 0 < max(most) <= WINDOW_CHUNKS, max(most)
        server = [r for r in caplog.records if r.name == "swarm.net.server"]
        assert [r.getMessage() for r in server if r.levelno > logging.INFO] == []
        assert any("dropped: stopped sending" in r.getMessage() for r in server), server
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))


# the slow sender's pause before each chunk: at 0.2 s (its fault's default) a loaded machine
# measured the fast senders at only 1.14x its rate once (2.7-3.4x idle); at 0.4 s 4.0-9.9x
# beside a running suite
SLOW_CHUNK_S = 0.4


@pytest.mark.timeout(90)
@pytest.mark.parametrize("aggregator", ["centered_clip", "mean"])
async def test_senders_ahead_of_a_slow_one_wait_within_the_window(monkeypatch, aggregator) -> None:
    """Under CenteredClip each chunk in flight holds one row per sender: three senders ahead
    of a slow one (SLOW_CHUNK_S per chunk) filled rows for all 16 chunks of every part. They
    now wait within WINDOW_CHUNKS of the chunks averaged, every part still averages all four,
    and the owners still measure the fast senders' uploads as fast. Under the plain mean each
    chunk in flight holds one row, its sum, within the same window (the part's buffer before)."""
    from swarm.averaging import faults as fault_module
    from swarm.averaging.butterfly.intake import WINDOW_CHUNKS

    monkeypatch.setattr(fault_module, "OVERCLAIM_DELAY_S", SLOW_CHUNK_S)
    most = _count_chunk_rows(monkeypatch)
    n, numel = 4, 16 << 20  # 16 chunks of 1 MiB per part
    peers = await start_peers([81, 82, 83, 84])
    config = fixed_group_config(n, f"window-{aggregator}", aggregator=aggregator)
    faults = [Fault.NONE] * (n - 1) + [Fault.OVERCLAIM]  # a slow uplink, honest values
    averagers = [Averager(p, config, fault=f) for p, f in zip(peers, faults, strict=True)]
    try:
        tensors = [make_tensor(i + 1, numel) for i in range(n)]
        results = await asyncio.gather(
            *(a.average([t]) for a, t in zip(averagers, tensors, strict=True))
        )
        for result in results:
            assert result.averaged and all(len(m) == n for m in result.parts.values()), result
        assert all(torch.equal(tensors[0], t) for t in tensors[1:])
        assert 0 < max(most) <= WINDOW_CHUNKS, max(most)
        # the time a sender was held is not its link's: fast senders stay measured as fast
        # (measured at 0.2 s a chunk: 2.7-3.4x the slow one's rate, beside a busy process;
        # 1.75x counting the time held)
        rates = averagers[0].rates
        slow = rates.get(peers[-1].peer_id)
        assert slow > 0 and min(rates.get(p.peer_id) for p in peers[1:-1]) > 2 * slow, slow
    finally:
        for a in averagers:
            await a.close()
        await asyncio.gather(*(p.close() for p in peers))
