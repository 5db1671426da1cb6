"""A part's stream whose connection is reset before its owner answered is sent once more.

Real peers behind the WAN emulator (tests/wan.py), which resets the first connection that
carries a part stream to each peer, before any of it reaches the peer: what a middlebox does, or
a peer closing a kept-alive connection as its caller reuses it. The owner never took that
stream, so the sender opens it again on a new connection instead of losing its part (its owner
then waited for it until the stall check gave up: 21 s in a 2-peer run of 1 s rounds).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from wan import WanEmulator

from swarm.averaging import Averager, AveragingConfig
from swarm.config import PeerConfig
from swarm.peer import Peer


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_part_stream_reset_before_its_answer_is_sent_again(codec: str) -> None:
    async with WanEmulator(first_host=120) as wan:
        nodes = [await wan.add_node(f"n{i}") for i in range(2)]
        peers: list[Peer] = []
        averagers: list[Averager] = []
        try:
            for node in nodes:
                initial = (str(nodes[0].announce),) if peers else ()
                config = PeerConfig(
                    run_id="resets",
                    listen=node.listen,
                    announce=node.announce,
                    initial_peers=initial,
                    heartbeat_s=2.0,
                )
                peers.append(await Peer.start(config))
            config = AveragingConfig(
                codec=codec,
                min_group_size=2,
                target_group_size=2,
                matchmaking_timeout_s=8.0,
                round_timeout_s=28.0,
                gather_window_s=0.1,
                group_key="resets",
                grouping="fixed",
                threads=1,
            )
            averagers = [Averager(p, config) for p in peers]
            for node in nodes:
                wan.reset_requests(node, b"POST /stream/avg.part")
            values = [torch.full((4096,), float(i)) for i in range(2)]
            results = await asyncio.gather(
                *(a.average([v]) for a, v in zip(averagers, values, strict=True))
            )
            assert wan.resets == 2  # each sender's first part stream
            for result, v in zip(results, values, strict=True):
                assert result.averaged and result.reason == "", result
                assert sorted(result.parts) == [0, 1] and all(
                    len(ids) == 2 for ids in result.parts.values()
                )
                torch.testing.assert_close(v, torch.full((4096,), 0.5), rtol=0, atol=0.01)
            assert not any(r.refusals for r in results)
        finally:
            await asyncio.gather(*(a.close() for a in averagers))
            await asyncio.gather(*(p.close() for p in peers))
