"""Real peers on one event loop, one per loopback address, for in-process swarm tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from swarm.config import PeerConfig
from swarm.peer import Peer


async def start_peers(
    hosts: Sequence[int], bandwidths: Sequence[float] | None = None, run_id: str = "avg-inproc"
) -> list[Peer]:
    """One peer per ``127.0.0.{host}``, all bootstrapping from the first."""
    peers: list[Peer] = []
    try:
        for i, host in enumerate(hosts):
            config = PeerConfig(
                run_id=run_id,
                listen=f"127.0.0.{host}:0",
                initial_peers=(str(peers[0].address),) if peers else (),
                bandwidth=bandwidths[i] if bandwidths else 1e6,
                heartbeat_s=2.0,
            )
            peers.append(await Peer.start(config))
    except BaseException:
        await asyncio.gather(*(p.close() for p in peers))
        raise
    return peers
