"""Upload rates of other peers as this peer measured them (sans-I/O).

A part owner times each sender's stream of its part: the bytes after the first chunk over the time
from the first chunk to the last. The sender was streaming to every other owner and answering
for its own part at the same time, so that rate times the streams it had open is what it
uploaded (:func:`stream_upload_rate`). It is a lower bound of its link: our download, both
sides' CPU and slow starts only ever make a stream slower.

A group's leader hands its measurements to the members in the group's answer, and every member
plans the parts with ``min(announced, measured)`` (:func:`~swarm.averaging.butterfly.parts.
effective_bandwidths`), so a peer cannot buy a larger part by announcing more than it delivers.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from swarm.identity import PeerID

MIN_MEASURED_CHUNKS = 3  # fewer chunks time the latency, not the link: no measurement
MAX_PEERS = 1024  # measurements kept, least recently measured dropped first
SMOOTHING = 0.5  # weight of a new measurement against the previous estimate


def stream_upload_rate(nbytes: int, chunks: int, elapsed: float, streams: int) -> float:
    """The sender's upload in bytes/s from one of its streams: ``nbytes`` received after its
    first chunk, ``chunks`` chunks in all, ``elapsed`` seconds from the first chunk to the last,
    while it had ``streams`` streams open. 0.0 when too short to tell."""
    if chunks < MIN_MEASURED_CHUNKS or not elapsed > 0 or nbytes <= 0:
        return 0.0
    return nbytes / elapsed * max(1, streams)


class PeerRates:
    """A smoothed upload rate per peer, bounded in size."""

    def __init__(self, max_peers: int = MAX_PEERS):
        self._rates: OrderedDict[PeerID, float] = OrderedDict()
        self._max = max_peers

    def observe(self, peer: PeerID, rate: float) -> None:
        """Fold one measurement (bytes/s) into ``peer``'s estimate; 0 or invalid is ignored."""
        if not (rate > 0 and math.isfinite(rate)):
            return
        old = self._rates.pop(peer, None)
        self._rates[peer] = rate if old is None else old + SMOOTHING * (rate - old)
        while len(self._rates) > self._max:
            self._rates.popitem(last=False)

    def get(self, peer: PeerID) -> float:
        """``peer``'s estimate in bytes/s; 0.0 when never measured."""
        return self._rates.get(peer, 0.0)

    def estimates(self, peers: Sequence[PeerID], me: PeerID) -> dict[PeerID, float]:
        """What a leader hands its group: each member's estimate, 0.0 for one never measured.
        A peer cannot time its own upload, so ``me`` gets the lower median of the others'
        measured rates: a leader's own claim then buys it no more than the others get."""
        out = {p: self.get(p) for p in peers if p != me}
        measured = sorted(r for r in out.values() if r > 0)
        out[me] = measured[(len(measured) - 1) // 2] if measured else 0.0
        return out

    def __len__(self) -> int:
        return len(self._rates)
