"""Bytes one peer moves in one butterfly round, from the codecs' exact payload sizes (no run).

A member of a group of ``N`` streams its share of every other member's part to that part's
owner and, as the owner of its own part, streams the part's average back to the ``N - 1``
others; it receives as much. The parts and chunks are the averager's own
(:class:`~swarm.averaging.butterfly.parts.PartPlan`, equal bandwidths, 1 MB chunks) and each
chunk's payload is :meth:`Codec.estimate_size`, which is exact for ``none``, ``int8`` and
``sparse`` (header included). Transport framing (a few dozen bytes per chunk) is left out.

One JSON object per (model size, codec, N) with the fields ``params``, ``codec``, ``peers``,
``sent_per_peer``, ``received_per_peer``, ``bytes_per_round`` (both directions), ``bits_per_param``
(sent, per parameter) and ``vs_none`` (how many times fewer bytes than fp32 rounds).

    python benchmarks/round_bytes.py --params 100e6 1e9 --peers 4 8
"""

from __future__ import annotations

import argparse
import json

from swarm.averaging.butterfly.parts import MAX_CHUNK_BYTES, PartPlan, chunk_elems_for
from swarm.compression import get_codec


def round_bytes(params: int, spec: str, peers: int) -> tuple[int, int]:
    """(sent, received) by member 0 of a group of ``peers`` averaging ``params`` values."""
    codec = get_codec(spec)
    plan = PartPlan.create(params, [1.0] * peers, chunk_elems_for(codec, MAX_CHUNK_BYTES))

    def part_bytes(j: int) -> int:
        return sum(codec.estimate_size(e - s) for s, e in plan.chunks(j))

    others = sum(part_bytes(j) for j in range(1, peers))
    own = part_bytes(0)
    sent = others + (peers - 1) * own  # shares to the owners, then our part's average back
    received = (peers - 1) * own + others  # their shares of our part, then their averages
    return sent, received


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, nargs="+", default=[100e6, 1e9])
    p.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--codecs", nargs="+", default=["none", "int8", "sparse"])
    args = p.parse_args()
    for params in map(int, args.params):
        for peers in args.peers:
            fp32 = sum(round_bytes(params, "none", peers))
            for spec in args.codecs:
                sent, received = round_bytes(params, spec, peers)
                print(
                    json.dumps(
                        {
                            "params": params,
                            "codec": spec,
                            "peers": peers,
                            "sent_per_peer": sent,
                            "received_per_peer": received,
                            "bytes_per_round": sent + received,
                            "bits_per_param": round(8 * sent / params, 4),
                            "vs_none": round(fp32 / (sent + received), 1),
                        }
                    )
                )


if __name__ == "__main__":
    main()
