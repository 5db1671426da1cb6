"""Real peers on one event loop, one per loopback address, for in-process swarm tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from swarm.config import AveragingConfig, PeerConfig
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


def fixed_group_config(n: int, group_key: str, **overrides: object) -> AveragingConfig:
    """Averaging in one fixed group of exactly ``n`` peers, with short test timeouts."""
    settings: dict[str, object] = {
        "codec": "none",
        "min_group_size": n,
        "target_group_size": n,
        "matchmaking_timeout_s": 8.0,
        "round_timeout_s": 38.0,
        "gather_window_s": 0.2,
        "group_key": group_key,
        "grouping": "fixed",
        "threads": 1,
    }
    settings.update(overrides)
    return AveragingConfig(**settings)  # type: ignore[arg-type]
