"""Convergence vs bytes: DiLoCo with compression against per-step gradient averaging (DDP-like).

    python benchmarks/convergence.py [--quick] [--peers 4] [--steps 400] [--plot-dir DIR]

A fixed task (a small CNN with BatchNorm on generated 16x16 images of 10 classes), N peers in one
process (threads; each with its own Swarm, loop thread and loopback port), each on a disjoint
shard, the same number of steps and samples for every configuration:

- ``gradients`` + ``none``: the reference, gradients averaged every step in fp32 (what DDP does);
- ``diloco`` with ``none``, ``int8``, ``topk:0.01`` and ``1bit`` (error feedback on).

Prints one JSON object per configuration (fields ``mode``, ``codec``, ``peers``, ``final_loss``,
``reference_final_loss``, ``bytes_sent_per_peer``, ``bytes_ratio_vs_reference``,
``step_overhead`` and a few more), then draws loss vs samples and loss vs bytes into PNGs when
matplotlib is installed (skipped with a note otherwise). ``step_overhead`` is the extra time of
``swarm.step()`` over ``optimizer.step()`` on steps that do not average.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time

import torch
from torch import nn

from swarm.api import Swarm

IMAGE, CLASSES = 16, 10


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy, shifted copies of 10 fixed class patterns; 20% of labels are random, so the loss
    has a floor well above 0 and relative loss differences mean something."""
    g = torch.Generator().manual_seed(1234)  # the class patterns are shared by every split
    patterns = torch.randn(CLASSES, 3, IMAGE, IMAGE, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (n,), generator=g)
    images = patterns[labels] + 2.0 * torch.randn(n, 3, IMAGE, IMAGE, generator=g)
    noisy = torch.rand(n, generator=g) < 0.2
    return images, torch.where(noisy, torch.randint(CLASSES, (n,), generator=g), labels)


def make_model() -> nn.Module:
    torch.manual_seed(0)

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.MaxPool2d(2),
        *block(64, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, CLASSES),
    )


def evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(data[0]), data[1]).item()
    model.train()
    return loss


def run(mode: str, codec: str, args: argparse.Namespace, train, test) -> dict:
    """Train ``args.peers`` peers for ``args.steps`` steps; returns curves and totals."""
    inner = 1 if mode == "gradients" else args.inner_steps
    n = args.peers
    swarms: list[Swarm | None] = [None] * n
    curves: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
    sent = [0] * n
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def peer(rank: int, initial: list[str]) -> None:
        try:
            model = make_model()
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            with Swarm(
                model,
                opt,
                run_id=f"bench-{mode}-{codec}".replace(":", "-"),
                initial_peers=initial,
                listen="127.0.0.1:0",
                mode=mode,
                inner_steps=inner,
                codec=codec,
                min_group_size=2,
                target_group_size=n,
                matchmaking_timeout_s=10.0,
                round_timeout_s=60.0,
            ) as swarm:
                swarms[rank] = swarm
                barrier.wait()
                x, y = train[0][rank::n], train[1][rank::n]
                g = torch.Generator().manual_seed(rank)
                for step in range(1, args.steps + 1):
                    idx = torch.randint(len(x), (args.batch,), generator=g)
                    nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    report = swarm.step(samples=args.batch)
                    opt.zero_grad(set_to_none=True)
                    sent[rank] += report.bytes_sent
                    eval_now = (report.round_due and mode == "diloco") or (
                        mode == "gradients" and step % args.inner_steps == 0
                    )
                    if rank == 0 and eval_now:
                        curves[0].append((step * args.batch * n, sent[0], evaluate(model, test)))
                barrier.wait()
                if rank == 0:
                    curves[0].append((args.steps * args.batch * n, sent[0], evaluate(model, test)))
                barrier.wait()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            barrier.abort()

    first = threading.Thread(target=peer, args=(0, []))
    first.start()
    while swarms[0] is None and first.is_alive():
        time.sleep(0.05)
    threads = [first]
    if swarms[0] is not None:
        threads += [
            threading.Thread(target=peer, args=(r, [swarms[0].address])) for r in range(1, n)
        ]
    for t in threads[1:]:
        t.start()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {
        "curve": curves[0],
        "bytes": statistics.mean(sent),
        "final": curves[0][-1][2],
        "wall_s": time.perf_counter() - start,
    }


class _EmulatedCodec:
    """Stand-in used only when swarm.compression is unavailable: same maths, sizes estimated."""

    def __init__(self, spec: str, block: int = 4096):
        self.name, _, arg = spec.partition(":")
        self.fraction = float(arg) if arg else 0.01
        self.block = block

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        n = x.numel()
        if self.name == "none":
            return x.clone(), 4 * n
        if self.name in ("fp16", "bf16"):
            dtype = torch.float16 if self.name == "fp16" else torch.bfloat16
            return x.to(dtype).float(), 2 * n
        pad = (-n) % self.block
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, self.block)
        if self.name == "int8":
            scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            out = (blocks / scale).round().clamp(-127, 127) * scale
            return out.flatten()[:n], n + 4 * blocks.shape[0]
        if self.name == "1bit":
            scale = blocks.abs().mean(dim=1, keepdim=True)
            out = torch.where(blocks >= 0, scale, -scale)
            return out.flatten()[:n], (n + 7) // 8 + 4 * blocks.shape[0]
        k = max(1, int(n * self.fraction))
        idx = x.abs().topk(k).indices
        out = torch.zeros_like(x)
        out[idx] = x[idx]
        return out, k * 4  # fp16 values + ~2-byte index deltas


def _codec_roundtrip(spec: str):
    """(x -> (decoded, payload bytes)) through swarm.compression when present, else emulated."""
    try:
        from swarm.compression import decode, get_codec
    except ImportError:
        return _EmulatedCodec(spec).roundtrip, "emulated"
    codec = get_codec(spec)

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        payload = codec.encode(x)
        return decode(payload).to(x.device).float(), len(payload)

    return roundtrip, "swarm.compression"


def run_simulated(mode: str, codec: str, args: argparse.Namespace, train, test) -> dict:
    """The same training in one thread: N engines, an exact butterfly average in memory.

    Each peer compresses its vector with error feedback, the part owners average the decoded
    values and send back the average compressed with their own error feedback (as the butterfly
    all-reduce does); bytes per peer per round are 2(N-1)/N x the payload.
    """
    from swarm.config import SwarmConfig
    from swarm.training.engine import TrainingEngine
    from swarm.training.rounds import RoundOutcome

    n = args.peers
    inner = 1 if mode == "gradients" else args.inner_steps
    roundtrip, codec_source = _codec_roundtrip(codec)
    engines = []
    for _ in range(n):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        engines.append(
            TrainingEngine(model, opt, SwarmConfig.build(mode=mode, inner_steps=inner, codec=codec))
        )
    residual = [None] * n
    owner_residual = None
    shards = [(train[0][r::n], train[1][r::n]) for r in range(n)]
    gens = [torch.Generator().manual_seed(r) for r in range(n)]
    sent, curve = 0.0, []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        due = False
        for e, (x, y), g in zip(engines, shards, gens, strict=True):
            idx = torch.randint(len(x), (args.batch,), generator=g)
            nn.functional.cross_entropy(e.model(x[idx]), y[idx]).backward()
            due = e.count(args.batch)
            if mode != "gradients":
                e.inner_step()
        if due:
            plans = [e.begin_round() for e in engines]
            flat = [torch.cat([t.flatten() for t in p.tensors]) for p in plans]
            decoded, payload = [], 0
            for r, v in enumerate(flat):
                v = v + (residual[r] if residual[r] is not None else 0)
                d, size = roundtrip(v)
                residual[r] = v - d
                decoded.append(d)
                payload = max(payload, size)
            weights = [p.weight for p in plans]
            mean = sum(w * d for w, d in zip(weights, decoded, strict=True)) / sum(weights)
            mean = mean + (owner_residual if owner_residual is not None else 0)
            back, _ = roundtrip(mean)
            owner_residual = mean - back
            sent += 2 * (n - 1) / n * payload
            for e, plan in zip(engines, plans, strict=True):
                offset = 0
                for t in plan.tensors:
                    t.copy_(back[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                e.finish_round(plan, RoundOutcome(True, n, 0, 0))
                if mode == "gradients":
                    e.inner_step()
        for e in engines:
            e.optimizer.zero_grad(set_to_none=True)
        if step % args.inner_steps == 0 or step == args.steps:
            curve.append((step * args.batch * n, int(sent), evaluate(engines[0].model, test)))
    return {
        "curve": curve,
        "bytes": sent,
        "final": curve[-1][2],
        "wall_s": time.perf_counter() - start,
        "codec_source": codec_source,
    }


def step_overhead(args: argparse.Namespace, train, backend: str) -> float:
    """Extra time of swarm.step() over optimizer.step() on steps that do not average.

    The two are timed in alternation (median of 9 x 200 steps) so load from other processes
    hits both alike. With ``sim`` the engine's step path is timed without the network (it is the
    same code: a step that does not average never touches the loop thread).
    """
    from swarm.config import SwarmConfig
    from swarm.training.engine import TrainingEngine

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x, y = train[0][: args.batch], train[1][: args.batch]
    nn.functional.cross_entropy(model(x), y).backward()
    swarm = None
    if backend == "swarm":
        swarm = Swarm(model, opt, run_id="overhead", listen="127.0.0.1:0", inner_steps=10**9)
        swarm_step = swarm.step
    else:
        engine = TrainingEngine(model, opt, SwarmConfig.build(inner_steps=10**9))

        def swarm_step() -> None:
            engine.count(None)
            engine.inner_step()
            engine.local_report()

    times: dict[str, list[float]] = {"optimizer": [], "swarm": []}
    try:
        for _ in range(9):
            for name, step in (("optimizer", opt.step), ("swarm", swarm_step)):
                t0 = time.perf_counter()
                for _ in range(200):
                    step()
                times[name].append(time.perf_counter() - t0)
    finally:
        if swarm is not None:
            swarm.close()
    return statistics.median(times["swarm"]) / statistics.median(times["optimizer"]) - 1.0


def plot(results: dict, plot_dir: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped"
    for xi, label in ((0, "samples"), (1, "bytes sent per peer")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, r in results.items():
            ax.plot([c[xi] for c in r["curve"]], [c[2] for c in r["curve"]], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("test loss")
        if xi == 1:
            ax.set_xscale("symlog")
        ax.legend()
        fig.savefig(f"{plot_dir}/loss_vs_{label.split()[0]}.png", dpi=120)
        plt.close(fig)
    return f"plots written to {plot_dir}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (a few minutes)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--codecs", nargs="+", default=["none", "int8", "topk:0.1", "topk:0.01", "1bit"])
    p.add_argument("--plot-dir", default=".")
    p.add_argument(
        "--backend",
        choices=["auto", "swarm", "sim"],
        default="auto",
        help="swarm: real peers on loopback; sim: one process, exact in-memory "
        "butterfly (used by auto when the network stack is not importable)",
    )
    args = p.parse_args()
    if args.quick:
        args.steps, args.inner_steps = 300, 30
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    train, test = make_data(32768, seed=1), make_data(2048, seed=2)
    backend = args.backend
    if backend == "auto":
        try:
            from swarm.averaging import Averager  # noqa: F401
            from swarm.peer import Peer  # noqa: F401
        except ImportError:
            backend = "sim"
        else:
            backend = "swarm"
    runner = run if backend == "swarm" else run_simulated
    overhead = step_overhead(args, train, backend)
    results = {"gradients/none": runner("gradients", "none", args, train, test)}
    reference = results["gradients/none"]
    for codec in args.codecs:
        results[f"diloco/{codec}"] = runner("diloco", codec, args, train, test)
    for name, r in results.items():
        mode, codec = name.split("/", 1)
        print(
            json.dumps(
                {
                    "mode": mode,
                    "codec": codec,
                    "peers": args.peers,
                    "steps": args.steps,
                    "inner_steps": 1 if mode == "gradients" else args.inner_steps,
                    "final_loss": round(r["final"], 5),
                    "reference_final_loss": round(reference["final"], 5),
                    "loss_vs_reference": round(r["final"] / reference["final"] - 1, 4),
                    "bytes_sent_per_peer": int(r["bytes"]),
                    "bytes_ratio_vs_reference": round(reference["bytes"] / max(r["bytes"], 1), 1),
                    "step_overhead": round(overhead, 4),
                    "backend": backend,
                    "codec_impl": r.get("codec_source", "swarm.compression"),
                    "wall_s": round(r["wall_s"], 1),
                }
            ),
            flush=True,
        )
    print(json.dumps({"note": plot(results, args.plot_dir)}), flush=True)


if __name__ == "__main__":
    main()
