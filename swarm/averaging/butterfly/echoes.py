"""Echoes: how closely a contribution repeats an update this peer applied rounds before.

A stale update (an attacker's own pseudo-gradient of some rounds ago, sent again) points
where honest updates point, delivers as much and is balanced like them: alignment, progress
and balance (:mod:`~swarm.averaging.butterfly.scoring`) read it as honest. What gives it away
is its age. It matches the update the group applied back then far better than a fresh one
does: on the slow-poison task, whole vectors against the honest mean of 9-10 rounds before
read 0.28-0.41 for the attacker and -0.07 to 0.03 for honest peers. So, in rounds that score
updates:

- after each round that averaged, a peer keeps the averaged update at a private random sample
  of positions (at most :data:`SAMPLE` of them) for its last :data:`HISTORY` rounds of that
  layout (:class:`UpdateHistory`); the positions are its own secret, so a sender cannot send
  fresh values where it is measured and stale ones elsewhere;
- an owner measures, chunk by chunk before the clip, each contribution's dot products at the
  positions in its part with each kept update (:class:`PartEchoes`): per contribution, its
  cosine with the update of 1, 2, ... rounds before, its own contribution's included;
- a record keeps, per lag, the running mean of a sender's cosine minus the scorer's own in
  the same part (:data:`ECHO_RATE`; the scorer's own update is fresh by its own account, and
  updates that share a direction for many rounds raise both alike); its **echo** is the
  largest mean of :data:`ECHO_WINDOW` neighbouring lags, from :data:`MIN_LAG` on
  (:func:`loudest`), judged on :data:`ECHO_SPREAD` widened by the records the scorer holds
  (as alignment is).

Why a window of lags: an update of 10 rounds ago also matches the updates of 8 to 12 rounds
ago (training moves smoothly), so an attacker's record rises over several neighbouring lags
(0.10-0.24 at lags 5-11 on the slow-poison task), while the noise of one lag does not: honest
peers holding 2 of 10 classes each had single lags up to +0.34 over the scorer's own, 0.11 at
most over a window of 5. Why from lag 4: an overlapped round's update is a round older than a
blocking one's, and the last rounds' updates share the outer momentum's direction. Honest
peers holding unlike data mostly read *below* the scorer's own (-0.1 to -0.4 per lag): the
scorer's own data is in every update it applied, theirs only in the rounds they shared its
group; the widened spread keeps their swings from lowering them. An update older than
:data:`HISTORY` rounds is not seen; it is also further from where training is.
"""

from __future__ import annotations

import bisect
import secrets
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from swarm.averaging.butterfly.alignment import cosine
from swarm.averaging.butterfly.kept import MAX_LAYOUTS

SAMPLE = 65536  # positions kept per layout: 4 MB of history at 16 rounds, whatever the model
HISTORY = 16  # rounds of applied updates kept per layout
MIN_LAG = 4  # echoes of the last rounds' updates are ordinary (overlapped rounds, momentum)
ECHO_WINDOW = 5  # neighbouring lags whose running means an echo averages
ECHO_RATE = 0.1  # weight of one part in a record's running means per lag
ECHO_SPREAD = 0.035  # full weight up to 2 spreads of echo above the scorer's own, floor at 4


@dataclass(frozen=True)
class EchoSample:
    """One round's view of a layout's history: the sampled ``positions`` of the flat vector
    (sorted) and the applied updates there, ``past[k - 1]`` the one of ``k`` rounds before."""

    positions: torch.Tensor  # int64, sorted, on the values' device
    past: torch.Tensor  # [lags, positions] float32
    bounds: Sequence[int]  # the positions on the host: slices found without a device sync


class _Layout:
    def __init__(self, numel: int, device: torch.device):
        g = torch.Generator().manual_seed(secrets.randbits(63))
        if numel <= SAMPLE:
            positions = torch.arange(numel)
        else:
            positions = torch.unique(torch.randint(0, numel, (SAMPLE,), generator=g))
        self.numel = numel
        self.positions = positions.to(device)
        self.bounds = positions.tolist()  # on the host, for each tensor's slice of them
        self.ring = torch.zeros(HISTORY, len(positions), dtype=torch.float32, device=device)
        self.kept = 0  # rounds in the ring
        self.newest = -1  # its row of the latest round


class UpdateHistory:
    """The updates this peer applied in its last :data:`HISTORY` scored rounds, per layout (a
    fragment and its size; at most :data:`~swarm.averaging.butterfly.kept.MAX_LAYOUTS`), at a
    private sample of positions. Not thread-safe: a layout's rounds run one at a time."""

    def __init__(self) -> None:
        self._layouts: dict[Hashable, _Layout] = {}

    def sample(self, layout: Hashable, numel: int) -> EchoSample | None:
        """The history of ``layout`` for a round about to run (None: no round kept yet)."""
        kept = self._layouts.get(layout)
        if kept is None or kept.kept == 0 or kept.numel != numel:
            return None
        rows = [(kept.newest - k) % HISTORY for k in range(kept.kept)]
        index = torch.tensor(rows, device=kept.ring.device)
        return EchoSample(kept.positions, kept.ring.index_select(0, index), kept.bounds)

    def record(self, layout: Hashable, tensors: Sequence[torch.Tensor]) -> None:
        """Keep the update of a round that averaged: ``tensors`` end to end, as applied."""
        numel = sum(t.numel() for t in tensors)
        if not tensors or numel == 0:
            return
        kept = self._layouts.get(layout)
        if kept is None or kept.numel != numel:
            kept = self._layouts[layout] = _Layout(numel, tensors[0].device)
            while len(self._layouts) > MAX_LAYOUTS:  # the least recently made dropped first
                self._layouts.pop(next(iter(self._layouts)))
        kept.newest = (kept.newest + 1) % HISTORY
        row = kept.ring[kept.newest]
        offset = 0
        for t in tensors:
            lo = bisect.bisect_left(kept.bounds, offset)
            hi = bisect.bisect_left(kept.bounds, offset + t.numel(), lo)
            if hi > lo:
                at = kept.positions[lo:hi] - offset
                row[lo:hi] = t.detach().reshape(-1).index_select(0, at.to(t.device)).float()
            offset += t.numel()
        kept.kept = min(HISTORY, kept.kept + 1)


class PartEchoes:
    """Each contribution's cosines with the kept updates, over one part of the flat vector
    (``start`` to ``end``), accumulated chunk by chunk (thread-safe: chunks reduce in
    parallel). Keys are member indices (the owner's own included)."""

    def __init__(self, sample: EchoSample, start: int, end: int):
        lo = bisect.bisect_left(sample.bounds, start)
        hi = bisect.bisect_left(sample.bounds, end, lo)
        self._start, self._bounds, self._span = start, sample.bounds, (lo, hi)
        self._local = sample.positions[lo:hi] - start  # positions relative to the part
        self._past = sample.past[:, lo:hi].double()
        self._lock = threading.Lock()
        self._dots: dict[int, list[float]] = {}
        self._norms2: dict[int, float] = {}
        self._past_norms2 = [0.0] * sample.past.shape[0]

    def add_chunk(self, members: Sequence[int], rows: torch.Tensor, start: int, end: int) -> None:
        """Measure ``rows`` (one per member, the chunk ``start:end`` of the part) before they
        are clipped."""
        lo, hi = self._span  # this part's positions, found on the host (no device sync)
        a = bisect.bisect_left(self._bounds, self._start + start, lo, hi) - lo
        b = bisect.bisect_left(self._bounds, self._start + end, lo, hi) - lo
        if b <= a:
            return
        at = (self._local[a:b] - start).to(rows.device)
        x = rows[:, : end - start].index_select(1, at).double()
        past = self._past[:, a:b].to(rows.device)
        dots = (x @ past.T).tolist()  # [members, lags]
        norms2 = (x * x).sum(dim=1).tolist()
        past_norms2 = (past * past).sum(dim=1).tolist()
        with self._lock:
            for m, d, n in zip(members, dots, norms2, strict=True):
                have = self._dots.setdefault(m, [0.0] * len(d))
                self._dots[m] = [h + v for h, v in zip(have, d, strict=True)]
                self._norms2[m] = self._norms2.get(m, 0.0) + n
            self._past_norms2 = [h + v for h, v in zip(self._past_norms2, past_norms2, strict=True)]

    def reset(self) -> None:
        with self._lock:
            self._dots.clear()
            self._norms2.clear()
            self._past_norms2 = [0.0] * len(self._past_norms2)

    def cosines(self, members: set[int]) -> dict[int, tuple[float, ...]]:
        """Per member of ``members`` measured, its cosine with the update of 1, 2, ... rounds
        before (0 where either is zero or not finite)."""
        with self._lock:
            return {
                m: tuple(
                    cosine(d, self._norms2[m], h)
                    for d, h in zip(dots, self._past_norms2, strict=True)
                )
                for m, dots in self._dots.items()
                if m in members
            }


def excess(echoes: Sequence[float], own: Sequence[float]) -> tuple[float, ...]:
    """A contribution's cosines with the kept updates minus the owner's own, lag by lag."""
    return tuple(e - o for e, o in zip(echoes, own, strict=True))


def follow_echo(before: Sequence[float] | None, measured: Sequence[float]) -> tuple[float, ...]:
    """A record's running means of excess per lag with one more part (lags not measured yet
    start at 0: an ordinary peer's)."""
    before = tuple(before or ()) + (0.0,) * max(0, len(measured) - len(before or ()))
    return tuple(
        (1 - ECHO_RATE) * b + ECHO_RATE * measured[k] if k < len(measured) else b
        for k, b in enumerate(before)
    )


def loudest(echo: Sequence[float] | None) -> tuple[int, float] | None:
    """The first lag of the :data:`ECHO_WINDOW` neighbouring lags (from :data:`MIN_LAG`)
    whose running means of excess are largest on average, and that average; None before a
    whole window was measured."""
    echo = tuple(echo or ())
    windows = [
        (lag, sum(echo[lag - 1 : lag - 1 + ECHO_WINDOW]) / ECHO_WINDOW)
        for lag in range(MIN_LAG, len(echo) - ECHO_WINDOW + 2)
    ]
    return max(windows, key=lambda kv: kv[1]) if windows else None
