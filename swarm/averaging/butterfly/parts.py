"""The part plan of a butterfly all-reduce (sans-I/O): who owns which slice of the flat vector.

The flat vector of ``numel`` elements is cut into one contiguous part per group member, in member
order, sized in proportion to each member's bandwidth: what it announced, but no more than the
group's leader measured it deliver (:func:`effective_bandwidths`); a member with bandwidth 0 (a
client behind NAT) owns an empty part but still sends and receives. Each part travels in chunks of
at most :func:`chunk_elems_for` elements, so one compressed chunk fits one transport frame.

Every member derives the same plan from the ordered member list, its announced and measured
bandwidths and the codec, so no plan crosses the wire. Chunks are as small as the group's slowest
measured link needs (:func:`chunk_bytes_for`): an owner averages chunk ``c`` only once every
sender delivered it, so on a slow link a large chunk holds up every reply behind it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from swarm.compression import Codec
from swarm.errors import AveragingError

MAX_CHUNK_BYTES = 1 << 20  # one compressed chunk per transport frame
MIN_CHUNK_BYTES = 128 << 10  # smaller chunks cost more per byte than they save in waiting
CHUNK_TIME_S = 0.15  # a chunk takes about this long on one stream of the slowest member
# an owner holds a float32 row per member for each chunk in flight: with 1M values (int8's
# 1 MiB) those rows took a whole 25M-value vector of a round's memory at N=4 (see the README)
MAX_CHUNK_ELEMS = 1 << 18
CHUNK_ALIGN = 4096  # a multiple of every codec's block size, so chunks quantize like the whole


def split_parts(
    numel: int, bandwidths: Sequence[float], first: int = 0
) -> tuple[tuple[int, int], ...]:
    """Contiguous ``(start, end)`` ranges, one per member, proportional to ``bandwidths``, laid
    out from member ``first`` on (``first`` owns the vector's start, then ``first + 1``, ...).

    Largest-remainder rounding, so the sizes sum to ``numel`` exactly and each differs from its
    ideal share by less than one element. When every bandwidth is 0 the split is equal (somebody
    has to own the vector).

    Raises:
        AveragingError: no members, a negative or non-finite bandwidth, or a negative numel.
    """
    if numel < 0:
        raise AveragingError(f"numel must be >= 0, got {numel}")
    if not bandwidths:
        raise AveragingError("a part plan needs at least one member")
    bws = [float(b) for b in bandwidths]
    if any(not math.isfinite(b) or b < 0 for b in bws):
        raise AveragingError(f"bandwidths must be finite and >= 0, got {bws}")
    if sum(bws) <= 0:
        bws = [1.0] * len(bws)
    # exact rational shares: float rounding must never hand out more than numel elements
    shares = [Fraction(b) for b in bws]
    total = sum(shares)
    ideal = [numel * b / total for b in shares]
    sizes = [math.floor(x) for x in ideal]
    short = numel - sum(sizes)
    # hand the leftover elements to the largest remainders among members that own something
    order = sorted(
        (i for i in range(len(bws)) if bws[i] > 0), key=lambda i: (sizes[i] - ideal[i], i)
    )
    for i in order[:short]:
        sizes[i] += 1
    ranges, start = [(0, 0)] * len(sizes), 0
    for k in range(len(sizes)):
        i = (first + k) % len(sizes)
        ranges[i] = (start, start + sizes[i])
        start += sizes[i]
    return tuple(ranges)


MEASURED_FLOOR = 64  # no measurement plans a member below the group's largest / this


def effective_bandwidths(announced: Sequence[float], measured: Sequence[float] = ()) -> list[float]:
    """The bandwidths a part plan may use: ``min(announced, measured)`` per member.

    ``measured`` (one per member, the group's leader's view; 0 or missing: never measured) is a
    lower bound of what the member uploads. A member never measured is planned with no more
    than the lower median of the group's claims, so a claim alone buys no more than a median
    share. No measurement pushes a member below the group's largest bandwidth /
    :data:`MEASURED_FLOOR` (its claim still bounds it), so a hostile leader cannot starve the
    others' parts to nothing and own the vector: it owns at most the share cap
    (:func:`cap_shares`), as any member does.

    Raises:
        AveragingError: a negative or non-finite announced bandwidth, a negative or NaN
            measurement, or more measurements than members.
    """
    claims = [float(b) for b in announced]
    if any(not math.isfinite(b) or b < 0 for b in claims):
        raise AveragingError(f"bandwidths must be finite and >= 0, got {claims}")
    rates = [float(m) for m in measured]
    if len(rates) > len(claims) or any(not m >= 0 for m in rates):
        raise AveragingError(f"measured bandwidths must be >= 0, one per member, got {rates}")
    rates += [0.0] * (len(claims) - len(rates))
    positive = sorted(b for b in claims if b > 0)
    if not positive:
        return claims
    median = positive[(len(positive) - 1) // 2]
    believed = [min(c, r if r > 0 else median) for c, r in zip(claims, rates, strict=True)]
    floor = max(believed) / MEASURED_FLOOR
    return [max(b, min(c, floor)) for c, b in zip(claims, believed, strict=True)]


def cap_shares(bandwidths: Sequence[float], max_share: float) -> list[float]:
    """Shares of the vector (summing to 1 over members with bandwidth > 0) proportional to
    ``bandwidths``, none above ``max_share / n`` where ``n`` members have bandwidth > 0: an
    announced bandwidth cannot buy a larger part than that (the excess goes to the others in
    proportion to theirs).

    Raises:
        AveragingError: a negative or non-finite bandwidth, or ``max_share < 1``.
    """
    bws = [float(b) for b in bandwidths]
    if any(not math.isfinite(b) or b < 0 for b in bws):
        raise AveragingError(f"bandwidths must be finite and >= 0, got {bws}")
    if not max_share >= 1:
        raise AveragingError(f"max_share must be >= 1, got {max_share}")
    owners = [i for i, b in enumerate(bws) if b > 0]
    if not owners:
        return bws
    cap = max_share / len(owners)
    capped: set[int] = set()
    while True:  # water-filling: at most len(owners) passes
        free = [i for i in owners if i not in capped]
        free_total = sum(bws[i] for i in free)
        left = 1.0 - cap * len(capped)
        over = {i for i in free if bws[i] / free_total * left > cap}
        if not over:
            break
        capped |= over
    shares = [0.0] * len(bws)
    for i in owners:
        shares[i] = cap if i in capped else bws[i] / free_total * left
    return shares


def chunk_bytes_for(measured: Sequence[float], members: int) -> int:
    """The chunk payload size for a group of ``members`` with the leader's ``measured``
    upload rates (bytes/s, 0: never measured): what the slowest measured member uploads on one
    of its ``2 (members - 1)`` streams in :data:`CHUNK_TIME_S`, rounded to a multiple of
    :data:`MIN_CHUNK_BYTES` up to :data:`MAX_CHUNK_BYTES` (the latter when nobody was measured).

    Behind 100 Mbit/s links (4 peers) that is 256 KB instead of 1 MB, and the replies'
    lag behind the senders' streams, which every round pays at its end, shrinks with it; on
    fast links chunks stay at the maximum, where the cost per chunk matters more.
    """
    rates = [r for r in measured if r > 0 and math.isfinite(r)]
    if not rates or members < 2:
        return MAX_CHUNK_BYTES
    size = min(rates) * CHUNK_TIME_S / (2 * (members - 1))
    # a few sizes only: plans stay alike from round to round
    size = round(size / MIN_CHUNK_BYTES) * MIN_CHUNK_BYTES
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, size))


def chunk_elems_for(codec: Codec, max_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Largest multiple of :data:`CHUNK_ALIGN` elements whose payload fits in ``max_bytes``."""
    per_elem_bound = codec.estimate_size(1 << 20) / float(1 << 20)
    guess = int(max_bytes / max(per_elem_bound, 1e-9)) // CHUNK_ALIGN * CHUNK_ALIGN
    n = max(CHUNK_ALIGN, min(guess, MAX_CHUNK_ELEMS))
    while n > CHUNK_ALIGN and codec.estimate_size(n) > max_bytes:
        n -= CHUNK_ALIGN
    return n


@dataclass(frozen=True)
class PartPlan:
    """Which member owns which range, and how ranges are chunked."""

    numel: int  # elements of the flat vector
    ranges: tuple[tuple[int, int], ...]  # (start, end) per member, in member order
    chunk_elems: int  # elements per chunk (the last chunk of a part may be shorter)

    @classmethod
    def create(
        cls,
        numel: int,
        bandwidths: Sequence[float],
        chunk_elems: int,
        max_share: float | None = None,
        first: int = 0,
    ) -> PartPlan:
        """The plan for ``bandwidths``, laid out from member ``first`` on; with ``max_share``,
        no member owns more than ``max_share / n`` of the vector (:func:`cap_shares`)."""
        if chunk_elems < 1:
            raise AveragingError("chunk_elems must be >= 1")
        if max_share is not None:
            bandwidths = cap_shares(bandwidths, max_share)
        return cls(numel, split_parts(numel, bandwidths, first), chunk_elems)

    def __len__(self) -> int:
        return len(self.ranges)

    def size(self, part: int) -> int:
        start, end = self.ranges[part]
        return end - start

    def chunks(self, part: int) -> tuple[tuple[int, int], ...]:
        """Absolute ``(start, end)`` of every chunk of ``part`` (empty for an empty part)."""
        start, end = self.ranges[part]
        return tuple(
            (s, min(s + self.chunk_elems, end)) for s in range(start, end, self.chunk_elems)
        )

    def num_chunks(self, part: int) -> int:
        return -(-self.size(part) // self.chunk_elems)

    def largest_chunk(self) -> int:
        """Values in the largest chunk of any part."""
        return min(self.chunk_elems, max((self.size(j) for j in range(len(self))), default=0))

    def owned(self) -> tuple[int, ...]:
        """Indices of the members that own a non-empty part."""
        return tuple(i for i in range(len(self.ranges)) if self.size(i) > 0)

    def streams(self, member: int) -> int:
        """How many streams ``member`` uploads on at once: one to every other owner, and an
        averaged part back to every other member when it owns one."""
        others = len(self.owned()) - (self.size(member) > 0)
        return others + (len(self.ranges) - 1 if self.size(member) > 0 else 0)


def schema_hash(tensors: Sequence[torch.Tensor], codec_spec: str) -> str:
    """Short hex digest of the tensors' shapes and dtypes and of the codec.

    Peers whose hashes differ use different matchmaking keys, so they never group: their flat
    vectors (or their payloads) would not line up.
    """
    h = hashlib.sha256(b"swarm/averaging/schema/v1")
    h.update(codec_spec.encode())
    for t in tensors:
        h.update(f"|{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:16]
