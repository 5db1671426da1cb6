"""A small GPT trained by a local swarm on the Python standard library's own source text.

    python examples/language_model.py                  # 2 peers, CPU, a few minutes
    python examples/language_model.py --peers 4 --layers 4 --dim 256 --steps 2000   # on a GPU

The corpus is every ``*.py`` file of this Python installation's standard library (offline, no
download), read as bytes (a 256-symbol vocabulary). Each peer trains on its own shard of the
text with AdamW, gradient accumulation and, on a GPU, ``torch.autocast`` in bfloat16; every
``--inner-steps`` optimizer steps the peers average their pseudo-gradients (``--codec``, int8 +
error feedback by default; ``--codec sparse`` sends about 1/33 of int8's bytes, for home uplinks)
in the background while training goes on (overlapped DiLoCo); with ``--fragments 2`` each round
averages half of the model, every ``--inner-steps`` / 2 steps (Streaming DiLoCo: half the peak
bandwidth). Peer 0 prints one line per round with its held-out loss. At the end the peers
average their models once (``average_parameters()``); the last line gives the held-out loss
after that, their own models' before it, and the bytes each sent. On several machines, run
one peer per machine with ``initial_peers=["HOST:PORT"]`` and ``listen="0.0.0.0:7000"``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sysconfig
import threading
from pathlib import Path

import torch
from torch import nn

from swarm.api import Swarm
from swarm.config import SwarmConfig
from swarm.errors import SwarmError


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's source, as one byte tensor (deterministic file order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class GPT(nn.Module):
    """Decoder-only transformer: byte embedding, learned positions, pre-norm blocks."""

    def __init__(self, context: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings
        nn.init.normal_(self.position, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.embed(tokens) + self.position[:n]
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def batch_of(text: torch.Tensor, size: int, context: int, g: torch.Generator, device: str):
    start = torch.randint(len(text) - context - 1, (size,), generator=g)
    rows = torch.stack([text[s : s + context + 1] for s in start.tolist()]).to(device)
    return rows[:, :-1], rows[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(x)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_peer(rank: int, args, text, held_out, peers: list[str], ready, out: list, ends: list):
    try:
        ends[rank] = run_peer(rank, args, text, held_out, peers, ready, out)
    except BaseException:
        ready.abort()  # the other peers stop waiting for this one and fail too
        out[rank] = None
        raise


def run_peer(rank: int, args, text, held_out, peers: list[str], ready, out: list):
    """Train one peer; its held-out loss after the last round and the bytes it sent."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)  # one initial model; joiners download peer 0's anyway
    model = GPT(args.context, args.dim, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    with Swarm(
        model,
        optimizer,
        run_id="language-model",
        initial_peers=peers,
        listen="127.0.0.1:0",
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        codec=args.codec,
        matchmaking_timeout_s=5.0,
        round_timeout_s=120.0,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    ) as swarm:
        out[rank] = swarm
        ready.wait()  # every peer is up: the shards are disjoint
        shard = text[rank * len(text) // args.peers : (rank + 1) * len(text) // args.peers]
        g = torch.Generator().manual_seed(1000 * args.seed + rank)
        sent = 0
        for _ in range(args.steps):
            for _ in range(args.accumulate):  # gradient accumulation: a larger effective batch
                x, y = batch_of(shard, args.batch, args.context, g, device)
                (loss_of(model, x, y, device) / args.accumulate).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            report = swarm.step(samples=args.batch * args.accumulate)
            optimizer.zero_grad(set_to_none=True)
            sent += report.bytes_sent  # a round that failed may have sent some too
            if report.round_due:
                # every peer measures, not only the one that prints: with rounds every
                # --inner-steps steps, a peer that did less work per round ran ahead until the
                # other missed a round (2-4 of 120 rounds at --steps 3000)
                held = held_out_loss(model, held_out, device)
                if rank == 0:
                    print(f"peer 0 {report.line(held)} ({held / math.log(2):.2f} bits/byte)")
        last = swarm.wait_round()  # land the last round before leaving
        sent += last.bytes_sent if last is not None else 0
        own = held_out_loss(model, held_out, device)
        ready.wait()  # every peer has landed its last round
        # one model for every peer (nothing to send where they hold one already; under a
        # sparse codec each model holds what its rounds left out: see average_parameters)
        final = swarm.average_parameters()
        sent += final.bytes_sent
        held = held_out_loss(model, held_out, device)
        ready.wait()  # stay up until everyone has finished the final average
        return own, held, sent


def held_out_loss(model: nn.Module, held_out, device: str) -> float:
    with torch.no_grad():
        x, y = held_out
        return loss_of(model, x.to(device), y.to(device), device).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per peer")
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument(
        "--fragments", type=int, default=1, help="Streaming DiLoCo fragments (divide inner steps)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--codec", default="int8", help="e.g. int8, sparse (see the README's codecs)")
    p.add_argument("--seed", type=int, default=0, help="the initial model and the batches")
    p.add_argument("--outer-lr", type=float, help="DiLoCo's outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, help="outer Nesterov momentum (default 0.9)")
    args = p.parse_args()
    try:  # check the options here, so that a bad value is one line, not a thread's traceback
        SwarmConfig.build(
            codec=args.codec, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum
        )
    except SwarmError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads() // args.peers))
    text = load_corpus(args.corpus_bytes)
    held_text, text = text[: len(text) // 20], text[len(text) // 20 :]
    held_out = batch_of(held_text, 256, args.context, torch.Generator().manual_seed(99), "cpu")
    print(f"corpus: {len(text)} bytes of standard-library source, {args.peers} peers")
    ready = threading.Barrier(args.peers)
    swarms: list[Swarm | None] = [None] * args.peers
    ends: list[tuple[float, int] | None] = [None] * args.peers
    first = threading.Thread(
        target=train_peer, args=(0, args, text, held_out, [], ready, swarms, ends)
    )
    first.start()
    while swarms[0] is None and first.is_alive():
        first.join(0.05)
    if swarms[0] is None:
        raise SystemExit("peer 0 failed to start")
    others = [
        threading.Thread(
            target=train_peer,
            args=(r, args, text, held_out, [swarms[0].address], ready, swarms, ends),
        )
        for r in range(1, args.peers)
    ]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join()
    if any(s is None for s in swarms) or any(e is None for e in ends):
        raise SystemExit("a peer failed (its traceback is above)")
    own = [loss / math.log(2) for loss, _, _ in ends]
    bits = [held / math.log(2) for _, held, _ in ends]
    mib = [sent / 2**20 for _, _, sent in ends]
    print(
        f"final ({args.codec}): held-out {sum(bits) / len(bits):.4f} bits/byte, mean of"
        f" {len(bits)} peers ({min(bits):.4f}-{max(bits):.4f}) after the final average;"
        f" their own models before it {sum(own) / len(own):.4f} ({min(own):.4f}-{max(own):.4f});"
        f" sent {sum(mib) / len(mib):.3f} MiB per peer"
    )


if __name__ == "__main__":
    main()
