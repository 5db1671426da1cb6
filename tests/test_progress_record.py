"""Progress and leave markers in peer records: round trip, and hostile fields refused."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from loopback_peers import start_peers

from swarm.address import PeerAddress
from swarm.errors import ConfigError, TransportError
from swarm.identity import Identity
from swarm.monitor.resources import machine_resources
from swarm.monitor.tracker import ProgressTracker, RoundFigures
from swarm.net import wire
from swarm.net.progress import LEFT_FIELD, PROGRESS_FIELD, Progress, Resources
from swarm.net.record import CONTEXT, FORMAT, PeerRecord

ADDRESS = PeerAddress("127.0.0.1", 7000)


def progress(**changes) -> Progress:
    fields = dict(
        role="trainer",
        round=12,
        step=480,
        samples_per_s=1234.5,
        loss=2.25,
        group_size=3,
        group="a1b2c3d4",
        codec="int8",
        bytes_in_per_s=1e6,
        bytes_out_per_s=2e6,
        utilization=0.93,
        reachability="public",
        uptime_s=360.0,
        resources=Resources("AMD Ryzen 9 7950X", 32, 64 << 30, "NVIDIA RTX 4090", 24 << 30),
    )
    return Progress(**{**fields, **changes})


def signed_record_bytes(identity: Identity, extra: dict) -> bytes:
    """A record signed by its owner whatever ``extra`` holds: what a hostile peer can send."""
    body = wire.pack(
        [
            FORMAT,
            identity.public_key,
            identity.agreement_key,
            identity.agreement_signature,
            ADDRESS.host,
            ADDRESS.port,
            "run",
            "cpu",
            1e6,
            "0.1.0",
            extra,
            1.7e9,
        ]
    )
    return wire.pack([body, identity.sign(CONTEXT + body)])


def test_progress_round_trips_through_a_signed_record() -> None:
    identity = Identity.generate()
    p = progress()
    record = PeerRecord.create(
        identity, address=ADDRESS, run_id="run", extra={PROGRESS_FIELD: p.to_wire()}
    )
    parsed = PeerRecord.parse(record.serialize())
    assert parsed.progress == p
    assert not parsed.left
    assert parsed.progress.as_dict()["resources"]["gpu"] == "NVIDIA RTX 4090"


def test_the_largest_progress_fits_beside_coordinates() -> None:
    big = progress(
        codec="x" * 24,
        group="g" * 24,
        resources=Resources("c" * 64, 1 << 16, 2**53, "g" * 64, 2**53),
        loss=-1e30,
    )
    extra = {PROGRESS_FIELD: big.to_wire(), "vc": [123.456] * 8}
    record = PeerRecord.create(Identity.generate(), address=ADDRESS, run_id="r", extra=extra)
    assert PeerRecord.parse(record.serialize()).progress == big


def test_a_leave_marker_parses_as_left() -> None:
    record = PeerRecord.create(
        Identity.generate(), address=ADDRESS, run_id="run", extra={LEFT_FIELD: True}
    )
    assert PeerRecord.parse(record.serialize()).left


def test_a_record_without_progress_still_parses() -> None:
    record = PeerRecord.create(Identity.generate(), address=ADDRESS, run_id="run")
    assert PeerRecord.parse(record.serialize()).progress is None


# name -> (index in the wire list, hostile value, field named in the refusal)
HOSTILE = {
    "negative round": (2, -1, "round"),
    "round beyond 2**53": (2, 2**60, "round"),
    "bool as a count": (3, True, "step"),
    "nan rate": (4, math.nan, "samples_per_s"),
    "infinite loss": (5, math.inf, "loss"),
    "text loss": (5, "low", "loss"),
    "huge group": (6, 10**6, "group_size"),
    "bytes as text": (7, b"abc", "group"),
    "newline in the codec": (8, "int8\nfake row", "codec"),
    "negative byte rate": (9, -1.0, "bytes_in_per_s"),
    "utilization above 1": (11, 1.5, "utilization"),
    "unknown reachability": (12, "everywhere", "reachability"),
    "unknown role": (1, "admin", "role"),
    "terminal escape in the cpu name": (14, "\x1b[2J\x1b[31mpwned", "cpu"),
    "float cores": (15, 8.0, "cores"),
    "negative ram": (16, -4, "ram"),
    "oversized gpu name": (17, "G" * 65, "gpu"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_progress_refuses_the_whole_record(name: str) -> None:
    index, value, field = HOSTILE[name]
    wire_form = progress().to_wire()
    wire_form[index] = value
    data = signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: wire_form})
    with pytest.raises(TransportError, match=f"progress field {field} "):
        PeerRecord.parse(data)


def test_a_short_or_unknown_format_progress_is_refused() -> None:
    # [:-3]: one item short of the resources (the later items, inner_steps and lowered, may be
    # missing)
    for wire_form in (progress().to_wire()[:-3], [99, *progress().to_wire()[1:]]):
        data = signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: wire_form})
        with pytest.raises(TransportError, match="format-1 list"):
            PeerRecord.parse(data)


def test_an_older_peers_progress_and_a_newer_ones_extra_items_are_read() -> None:
    oldest = progress().to_wire()[:-2]  # a peer from before inner_steps was published
    assert Progress.from_wire(oldest).inner_steps == 0
    older = progress(inner_steps=5).to_wire()[:-1]  # from before lowered peers were
    assert Progress.from_wire(older) == progress(inner_steps=5, lowered=())
    newer = [*progress().to_wire(), "a field of a later version"]
    assert Progress.from_wire(newer) == progress()
    bad = [*progress().to_wire()[:-2], -3]
    with pytest.raises(ConfigError, match="inner_steps"):
        Progress.from_wire(bad)


LOWERED = (("abcdefghij", 0.02, "aligned -0.61 on average, others 0.70 +- 0.10"),)


def test_lowered_peers_round_trip_through_the_record() -> None:
    p = progress(lowered=LOWERED)
    identity = Identity.generate()
    data = signed_record_bytes(identity, {PROGRESS_FIELD: p.to_wire()})
    assert Progress.from_wire(PeerRecord.parse(data).extra[PROGRESS_FIELD]) == p
    assert p.as_dict()["lowered"] == [list(LOWERED[0])]


@pytest.mark.parametrize(
    "lowered",
    [
        "abcdefghij",  # not a list
        [["abcdefghij", 0.5, "x"]] * 9,  # too many
        [["abcdefghij", 0.5]],  # short entry
        [["abcdefghij", 1.5, "x"]],  # weight out of range
        [["abcdefghij", float("nan"), "x"]],
        [["abcdefghij", True, "x"]],
        [["a" * 25, 0.5, "x"]],  # oversized id
        [["abcdefghij", 0.5, "x" * 65]],  # oversized reason
        [["abcdefghij", 0.5, "\x1b[2Jcleared"]],  # terminal escape
        [[7, 0.5, "x"]],
        [None],
    ],
    ids=repr,
)
def test_hostile_lowered_peers_refuse_the_whole_record(lowered) -> None:
    wire_form = [*progress().to_wire()[:-1], lowered]
    data = signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: wire_form})
    with pytest.raises(TransportError, match="progress field lowered"):
        PeerRecord.parse(data)


@pytest.mark.parametrize("value", [1, False, "yes", None, [True]])
def test_a_leave_marker_other_than_true_is_refused(value: object) -> None:
    data = signed_record_bytes(Identity.generate(), {LEFT_FIELD: value})
    with pytest.raises(TransportError):
        PeerRecord.parse(data)


def test_a_progress_that_is_not_a_list_is_refused() -> None:
    for junk in ({"round": 1}, "progress", 7, [1] * 200):
        with pytest.raises(TransportError):
            PeerRecord.parse(signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: junk}))


def test_oversized_progress_is_refused_by_the_record_size_cap() -> None:
    wire_form = progress().to_wire() + ["pad" * 100] * 4  # trailing items, over the extra cap
    with pytest.raises(TransportError):
        PeerRecord.parse(signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: wire_form}))


def test_trailing_items_from_a_newer_version_are_ignored() -> None:
    wire_form = [*progress().to_wire(), 1, "new"]
    record = PeerRecord.parse(signed_record_bytes(Identity.generate(), {PROGRESS_FIELD: wire_form}))
    assert record.progress == progress()


@given(
    st.lists(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=True),
            st.text(max_size=80),
            st.binary(max_size=10),
        ),
        max_size=24,
    )
)
def test_arbitrary_progress_lists_parse_or_raise_config_error(items: list) -> None:
    with contextlib.suppress(ConfigError):
        Progress.from_wire(items)


def test_tracker_turns_counters_into_rates() -> None:
    class Engine:
        round = 0
        step_count = 0
        samples_seen = 0.0

        class utilization:  # mimics the engine's attribute
            value = 0.8

        class cadence:  # mimics the engine's attribute
            inner_steps = 25

    engine = Engine()
    tracker = ProgressTracker()
    tracker.attach(engine, "int8")
    tracker._mark = (tracker._mark[0] - 10.0, 0.0, 0, 0)  # as if the last heartbeat was 10 s ago
    engine.round, engine.step_count, engine.samples_seen = 3, 30, 1000.0
    tracker.note_loss(float("nan"))
    assert tracker.loss is None
    tracker.note_loss(torch.tensor(0.75, requires_grad=True) * 2)  # read at the heartbeat
    assert tracker.loss == 1.5
    tracker.on_round(RoundFigures(True, "", "abcd", 3, 4000, 2000, 1.0, 0.2, 0.8))
    p = tracker.snapshot(reachability="client")
    assert p.role == "trainer" and p.round == 3 and p.step == 30 and p.loss == 1.5
    assert p.samples_per_s == pytest.approx(100.0, rel=0.05)
    assert p.bytes_out_per_s == pytest.approx(400.0, rel=0.05)
    assert p.bytes_in_per_s == pytest.approx(200.0, rel=0.05)
    assert p.group_size == 3 and p.group == "abcd" and p.codec == "int8"
    assert p.inner_steps == 25
    assert p.utilization == 0.8
    assert p.resources == machine_resources()


class _ManyLowered:
    """A scorer's records that lowered 8 peers, each with the longest reason allowed."""

    def lowered(self, limit: int) -> tuple[tuple[str, float, str], ...]:
        return tuple((f"peer{i:06d}", 0.0123, "r" * 64) for i in range(limit))


async def test_a_scorer_that_lowered_many_peers_still_announces_its_record() -> None:
    """8 lowered peers with long reasons beside a coordinate and full gone and apart lists
    overflow the record's extra: the peer announces fewer of them rather than no record."""
    (peer,) = await start_peers([151])
    try:
        peer.progress.records = _ManyLowered()
        tags = ["0123456789ab"] * 8
        transport = peer.transport
        transport.update_record(
            extra={**transport.record().extra, "vc": [123.456] * 8, "gn": tags, "ap": tags}
        )
        assert await peer.announce() >= 1
        shown = Progress.from_wire(transport.record().extra[PROGRESS_FIELD])
        assert 0 < len(shown.lowered) < 8
        assert transport.record().extra["ap"] == tags  # the rest of the record is kept
    finally:
        await peer.close()
