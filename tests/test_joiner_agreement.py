"""A late joiner adopts the state a weighted majority of providers agree on, nothing else."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch

from swarm.api import AsyncSwarm
from swarm.auth import Membership
from swarm.errors import TrainingError
from swarm.identity import Identity
from swarm.net.transport import Transport
from swarm.training.agreement import (
    AGE_CAP_S,
    AGE_GRACE_S,
    AGE_UNIT_S,
    SKETCH_SLICES,
    Manifest,
    agree,
    provider_weight,
    shares_of,
    sketch_distance,
    sketch_of,
    weighted_median,
)
from swarm.training.snapshot import MAX_ROUND
from swarm.training.transfer import STATE_STREAM, Fault, ask_manifest

SKETCH = tuple(float(i + 1) for i in range(8))


def manifest(name: str, round_: int = 10, scale: float = 1.0, **kw) -> Manifest:
    provider = SimpleNamespace(peer_id=name)
    sketch = kw.pop("sketch", tuple(x * scale for x in SKETCH))
    return Manifest(provider, round_, 100, kw.pop("sha", name * 64)[:64], 0, sketch, **kw)


def names(ms) -> list[str]:
    return sorted(m.provider.peer_id for m in ms)


def test_lone_provider_far_ahead_is_refused() -> None:
    v = agree([manifest("a"), manifest("b", 11), manifest("c", 10**9)], sketch_len=8)
    assert names(v.accepted) == ["a", "b"] and v.majority
    ((liar, why),) = v.refused
    assert liar.provider.peer_id == "c" and "far ahead" in why


def test_values_and_loss_out_of_line_are_refused() -> None:
    ms = [manifest("a", loss=0.5), manifest("b", scale=1.02, loss=0.6), manifest("c", scale=100)]
    v = agree(ms, sketch_len=8)
    assert names(v.accepted) == ["a", "b"] and "away from" in v.refused[0][1]
    ms = [manifest("a", loss=0.5), manifest("b", loss=0.6), manifest("c", loss=0.55)]
    ms.append(manifest("d", loss=9.0))
    v = agree(ms, sketch_len=8)
    assert names(v.accepted) == ["a", "b", "c"] and "loss" in v.refused[0][1]
    nan = manifest("e", sketch=(float("nan"),) * 8)
    short = manifest("f", sketch=SKETCH[:4])
    bad_loss = manifest("g", loss=float("inf"))
    v = agree([manifest("a"), nan, short, bad_loss], sketch_len=8)
    # broken offers count nowhere, not even in the denominator (issue 35: they used to deny)
    assert names(v.accepted) == ["a"] and v.majority and v.total == 1.0
    assert sorted(m.provider.peer_id for m, _ in v.refused) == ["e", "f", "g"]


def test_no_majority_and_duplicates() -> None:
    assert not agree([manifest("a"), manifest("b", scale=10)], sketch_len=8).majority
    same = manifest("a")
    v = agree([same, same, same, manifest("b", scale=10)], sketch_len=8)
    assert not v.majority  # one provider answering three times is one voice
    assert agree([manifest("a")], sketch_len=8).majority  # a swarm of one provider


def test_candidates_prefer_more_holders_then_newer_rounds() -> None:
    ms = [manifest("a", sha="x"), manifest("b", sha="x"), manifest("c", 11, sha="y")]
    groups = agree(ms, sketch_len=8).candidates()
    assert [names(g) for g in groups] == [["a", "b"], ["c"]]


def test_sketch() -> None:
    values = torch.arange(1000, dtype=torch.float32)
    s = sketch_of(values)
    assert len(s) == SKETCH_SLICES and sketch_distance(s, s) == 0
    assert len(sketch_of(torch.ones(5))) == 5 and sketch_of(torch.zeros(0)) == ()
    assert sketch_distance((1.0,), (1.0, 2.0)) == float("inf")


def test_weights_grow_with_record_age_past_a_grace_to_a_cap() -> None:
    assert provider_weight(0.0) == provider_weight(-5.0) == provider_weight(math.nan) == 1.0
    assert provider_weight(AGE_GRACE_S) == 1.0  # a second more or less among the fresh: nothing
    assert provider_weight(60.0) == 1 + (60 - AGE_GRACE_S) / AGE_UNIT_S == 10.0
    assert provider_weight(AGE_CAP_S) == provider_weight(10 * AGE_CAP_S) > provider_weight(60.0)


def test_three_fresh_sybils_far_ahead_do_not_outvote_a_peer_of_a_minute() -> None:
    honest = manifest("honest", 75, age_s=60.0)
    sybils = [manifest(f"s{i}", 75 + 10**9, scale=1000, sha="x", age_s=5.0) for i in range(3)]
    v = agree([honest, *sybils], sketch_len=8)
    assert names(v.accepted) == ["honest"] and v.majority, v
    assert v.weight == 10.0 and v.total == pytest.approx(13.0)
    assert {m.provider.peer_id for m, _ in v.refused} == {"s0", "s1", "s2"}
    # by count alone (nobody's age known yet) the same offers would have gone to the sybils:
    # the weights decide, nothing else
    fresh = manifest("honest", 75)
    v = agree([fresh, *(dataclasses.replace(m, age_s=0.0) for m in sybils)], sketch_len=8)
    assert names(v.accepted) == ["s0", "s1", "s2"]
    # nine fresh identities still lose to a minute; ten tie, and a tie decides nothing
    many = [manifest(f"s{i}", 75 + 10**9, scale=1000, sha="x") for i in range(9)]
    assert names(agree([honest, *many], sketch_len=8).accepted) == ["honest"]
    many.append(manifest("s9", 75 + 10**9, scale=1000, sha="x"))
    assert not agree([honest, *many], sketch_len=8).majority


def test_providers_of_one_subnet_share_the_weight_of_their_oldest() -> None:
    honest = manifest("honest", 75, subnet="192.0.2.0/24")
    sybils = [
        manifest(f"s{i}", 75 + 10**9, scale=1000, sha="x", subnet="198.51.100.0/24")
        for i in range(50)
    ]
    v = agree([honest, *sybils], sketch_len=8)
    assert not v.majority and v.total == pytest.approx(2.0)  # a subnet against one: a tie
    ally = manifest("ally", 76, subnet="203.0.113.0/24")
    v = agree([honest, ally, *sybils], sketch_len=8)
    assert names(v.accepted) == ["ally", "honest"] and v.majority
    # inside one subnet the weight splits by age: the old member keeps most of it
    shares = shares_of([("old", 60.0, "n"), ("new", 0.0, "n"), ("other", 0.0, "m")])
    assert shares == pytest.approx({"old": 10 * 10 / 11, "new": 10 / 11, "other": 1.0})


def test_a_tie_or_only_broken_offers_decide_nothing() -> None:
    v = agree([manifest("a"), manifest("b", scale=10)], sketch_len=8)
    assert not v.majority and v.weight <= v.total / 2
    broken = [
        manifest("n", sketch=(math.inf,) * 8),
        manifest("r", 2**41),
        manifest("l", loss=math.nan),
    ]
    v = agree(broken, sketch_len=8)
    assert not v.majority and v.accepted == () and v.total == 0.0 and len(v.refused) == 3
    assert "2^40" in dict((m.provider.peer_id, w) for m, w in v.refused)["r"]


def test_candidates_prefer_the_heaviest_holders() -> None:
    ms = [manifest("a", sha="x"), manifest("b", sha="x"), manifest("c", sha="y", age_s=30.0)]
    groups = agree(ms, sketch_len=8).candidates()
    assert [names(g) for g in groups] == [["c"], ["a", "b"]]


def test_weighted_median() -> None:
    assert weighted_median([1, 2, 3], [1, 1, 1]) == 2
    assert weighted_median([1, 2, 3, 4], [1, 1, 1, 1]) == 2.5
    assert weighted_median([1, 2, 3, 4], [1, 1, 1, 1], low=True) == 2
    assert weighted_median([1, 100, 200], [10, 1, 1]) == 1


# -- against real providers ------------------------------------------------------------------


OPTIONS = {"listen": "127.0.0.1:0", "codec": "none", "heartbeat_s": 2.0, "inner_steps": 2}


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


async def start(seed: int, peers=(), **kw) -> AsyncSwarm:
    m = model(seed)
    return await AsyncSwarm.create(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        run_id="agree",
        initial_peers=list(peers),
        **{**OPTIONS, **kw},
    )


async def providers_and_a_liar() -> list[AsyncSwarm]:
    """Two honest providers and a third (last) that the test makes lie."""
    a = await start(0, sync_on_join=False)
    peers = [a]
    try:
        peers.append(await start(1, [a.address]))
        peers.append(await start(2, [a.address]))
    except BaseException:
        for p in reversed(peers):
            await p.close()
        raise
    return peers


@pytest.mark.parametrize("fault", [Fault.LIE_ROUND, Fault.LIE_WEIGHTS])
async def test_joiner_facing_one_lying_provider_of_three_adopts_the_honest_state(
    fault: Fault, caplog
) -> None:
    peers = await providers_and_a_liar()
    a, liar = peers[0], peers[-1]
    try:
        liar._provider.fault = fault
        honest = [t.clone() for t in a.model.state_dict().values()]
        with caplog.at_level(logging.WARNING, logger="swarm.training.transfer"):
            joiner = await start(3, [a.address])
        peers.append(joiner)
        got = list(joiner.model.state_dict().values())
        assert all(torch.equal(x, y) for x, y in zip(honest, got, strict=True))
        assert joiner.round == a.round < 10
        refused = dict(joiner.joined.refused)
        assert list(refused) == [liar.peer.peer_id], refused
        assert liar.peer.peer_id not in joiner.joined.providers
        assert "refused" in caplog.text and liar.peer.peer_id.short in caplog.text
    finally:
        for p in reversed(peers):
            await p.close()


@pytest.mark.parametrize("lie", [2**50, "40", -1, 2**60])
async def test_joiner_plans_with_its_providers_round_order_whatever_one_claims(lie) -> None:
    """The joiner's first plans use the order its providers plan with (their median), so they
    match theirs; one provider's huge or malformed order moves nothing."""
    peers = await providers_and_a_liar()
    a, liar = peers[0], peers[-1]
    try:
        for p in peers[:2]:
            p.averager.planner.order = 40
        liar._provider.order = lambda: lie
        joiner = await start(3, [a.address])
        peers.append(joiner)
        assert joiner.averager.order == 40
        assert joiner.round == a.round  # the training round is the downloaded one
    finally:
        for p in reversed(peers):
            await p.close()


async def undecided_joiner(address: str, caplog) -> tuple[AsyncSwarm, list, str]:
    """A joiner that cannot decide: it starts anyway, with its own weights untouched (issue 35:
    it used to raise out of the constructor), and says why in exactly one WARNING."""
    victim = model(3)
    before = [t.clone() for t in victim.state_dict().values()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swarm.training.joining"):
        joiner = await AsyncSwarm.create(
            victim,
            torch.optim.SGD(victim.parameters(), lr=0.1),
            run_id="agree",
            initial_peers=[address],
            **OPTIONS,
        )
    warnings = [r for r in caplog.records if r.name == "swarm.training.joining"]
    assert len(warnings) == 1 and "could not decide" in warnings[0].message, caplog.text
    after = victim.state_dict().values()
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert joiner.joined is None and joiner.round == 0
    assert not joiner._provider.offering  # an undecided state is not offered before it trains
    return joiner, warnings, warnings[0].message


async def test_no_majority_trains_its_own_weights_and_offers_them_only_after_a_round(
    caplog,
) -> None:
    """One honest provider between two liars of about its age, each lying its own way: no state
    holds a majority of the weight, whoever wins the medians."""
    peers = await providers_and_a_liar()
    a, liar_round, liar_weights = peers
    try:
        liar_round._provider.fault = Fault.LIE_ROUND
        liar_weights._provider.fault = Fault.LIE_WEIGHTS
        joiner, _, why = await undecided_joiner(a.address, caplog)
        peers.append(joiner)
        assert "no weighted majority" in why, why
        for _ in range(OPTIONS["inner_steps"]):
            joiner.model(torch.ones(1, 6)).sum().backward()
            await joiner.step()
        await joiner.wait_round()
        assert joiner.round == 1 and joiner._provider.offering
    finally:
        for p in reversed(peers):
            await p.close()


async def test_nan_state_behind_an_honest_sketch_is_never_loaded(caplog) -> None:
    liar = await start(0, sync_on_join=False)
    try:
        liar._provider.fault = Fault.LIE_NAN  # announces a plausible sketch, serves NaN
        joiner, _, why = await undecided_joiner(liar.address, caplog)
        await joiner.close()
        assert re.search(r"NaN or Inf|not finite", why), why
    finally:
        await liar.close()


async def test_a_manifest_past_the_sane_round_is_refused_and_counts_nowhere(caplog) -> None:
    """One honest provider and one claiming round 2^50 (msgpack carries no 2^70): the claim is
    refused before any majority, so the honest state is adopted, 1 of 1."""
    peers = await providers_and_a_liar()
    a, honest, liar = peers
    try:
        await honest.close()  # two providers only: a liar counted in the denominator would tie
        peers.remove(honest)
        liar.engine.round = liar.engine.offer_from_round = 2**50  # its snapshot says so too
        with pytest.raises(TrainingError, match="past the largest sane round"):
            await ask_manifest(a.peer.transport, liar.peer.transport.record(), a.engine.schema, 10)
        joiner = await start(3, [a.address])
        peers.append(joiner)
        assert joiner.round == a.round < 10 and joiner.joined is not None
        refused = dict(joiner.joined.refused)
        assert "past the largest sane round" in refused[liar.peer.peer_id]
        assert list(joiner.joined.providers) == [a.peer.peer_id]
    finally:
        for p in reversed(peers):
            await p.close()


GOOD_REPLY = {
    "ok": True,
    "round": 5,
    "size": 100,
    "sha256": "ab" * 32,
    "steps_in_round": 0,
    "sketch": list(SKETCH),
    "loss": 0.5,
    "order": 5,
}
MALFORMED_REPLIES = [
    {"round": 2**64 - 1},
    {"round": MAX_ROUND + 1},
    {"round": -1},
    {"round": "40"},
    {"round": True},
    {"round": 1.5},
    {"size": -5},
    {"sha256": "ab" * 31},
    {"sha256": 7},
    {"sketch": [1.0] * (SKETCH_SLICES + 1)},
    {"sketch": ["a"]},
    {"sketch": [True]},
    {"sketch": "1,2"},
    {"loss": "low"},
    {"loss": False},
    {"order": 2**60},
    {"order": -3},
    {"steps_in_round": None},
]


async def test_hostile_manifest_replies_are_refused_or_count_nowhere() -> None:
    """A provider answering anything at all: a declined or malformed manifest is never an
    offer, and a well-formed one with non-finite numbers is one that counts nowhere."""
    reply: dict = {}

    async def hostile(request, stream) -> None:
        async for _ in request:
            pass
        await stream.prepare(reply)

    server = Transport(Identity.generate(), Membership.open(), run_id="agree", listen="127.0.0.1:0")
    client = Transport(Identity.generate(), Membership.open(), run_id="agree", listen="127.0.0.1:0")
    server.add_stream(STATE_STREAM, hostile)
    await server.start()
    await client.start()
    try:
        target = server.record()

        async def ask(header: dict):
            reply.clear()
            reply.update(header)
            return await ask_manifest(client, target, "schema", 10)

        assert isinstance(await ask(GOOD_REPLY), Manifest)  # the harness itself works
        assert await ask({"ok": False, "reason": "no state to offer yet"}) is None
        assert await ask({**GOOD_REPLY, "ok": "yes"}) is None  # only True offers
        for change in MALFORMED_REPLIES:
            with pytest.raises(TrainingError):
                await ask({**GOOD_REPLY, **change})
        for change in ({"sketch": [math.nan] * 8}, {"sketch": [math.inf] * 8}, {"loss": math.nan}):
            m = await ask({**GOOD_REPLY, **change})
            v = agree([m, manifest("honest", 5)], sketch_len=8)
            assert v.majority and v.total == 1.0 and names(v.accepted) == ["honest"], change
    finally:
        await client.close()
        await server.close()
