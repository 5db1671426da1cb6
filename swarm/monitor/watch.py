"""The log lines people need: "peer X joined (N peers)" and "peer X left"."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from swarm.identity import PeerID

logger = logging.getLogger(__name__)


class PeerWatcher:
    """Compares successive listings of a run's peers and logs who came and who went.

    The first listing is the starting point (logged as one line, not one per peer); after that
    every newcomer gets one INFO line and every departure (leave marker or expired record) one.
    """

    def __init__(self, me: PeerID):
        self.me = me
        self.known: set[PeerID] | None = None

    def update(self, live: Iterable[PeerID], left: Iterable[PeerID] = ()) -> None:
        """``live``: peers with a current record; ``left``: peers whose leave marker we saw."""
        current = set(live) | {self.me}
        if self.known is None:
            if len(current) > 1:
                logger.info("%d peers in the run", len(current))
            self.known = current
            return
        for pid in sorted(current - self.known, key=str):
            logger.info("peer %s joined (%d peers)", pid.short, len(current))
        departed = set(left)
        for pid in sorted(self.known - current, key=str):
            how = "left" if pid in departed else "left (its record expired)"
            logger.info("peer %s %s (%d peers)", pid.short, how, len(current))
        self.known = current
