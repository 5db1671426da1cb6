"""Codec benchmark: ratio, speed and error per codec and value distribution.

Prints one JSON object per (codec, dist):
    codec, dist, numel, device, ratio (fp32 bytes / payload bytes), payload_bytes,
    encode_gbps / decode_gbps / decode_into_gbps (GB/s of fp32 input, best of --repeats),
    rel_l2_error (||D(C(x)) - x|| / ||x||, one shot, no feedback),
    ef_rel_error_100 (with error feedback: ||sum D - sum x|| / ||sum x|| after 100 steps of
    fresh inputs, on a vector of ef_numel elements), noef_rel_error_100 (same without feedback).

    python benchmarks/compression.py              # 25M elements
    python benchmarks/compression.py --quick      # 2M elements, one repeat
    python benchmarks/compression.py --device cuda
On CUDA the timings include the copy of the payload to/from host memory.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarm.compression import ErrorFeedback, decode, decode_into, get_codec

CODECS = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:4096:bnb",
    "topk:0.01",
    "topk:0.01:int8",
    "1bit",
    "sparse",
    "sparse:64:1:2",
)


def sample(dist: str, numel: int, gen: torch.Generator) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(numel, generator=gen)
    # Student-t with df=2 (infinite variance), scaled: z / sqrt(chi2_2 / 2).
    z = torch.randn(numel, generator=gen)
    chi2 = -2.0 * torch.log(torch.rand(numel, generator=gen).clamp_min_(1e-12))
    return z.div_(chi2.div_(2.0).sqrt_()).mul_(0.1)


def best_time(fn, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def ef_error(
    spec: str, dist: str, numel: int, steps: int, feedback: bool, device: torch.device
) -> float:
    gen = torch.Generator().manual_seed(1)
    codec = get_codec(spec)
    ef = ErrorFeedback(codec)
    sent = torch.zeros(numel, device=device)
    total = torch.zeros(numel, device=device)
    for _ in range(steps):
        x = sample(dist, numel, gen).to(device)
        total += x
        payload = ef.encode(x) if feedback else codec.encode(x)
        decode_into(payload, sent)
    return rel(sent, total)


def run(spec: str, dist: str, x: torch.Tensor, repeats: int, ef_numel: int) -> dict:
    codec = get_codec(spec)
    numel, dev = x.numel(), x.device
    payload = codec.encode(x)  # warm-up: scratch buffers, bnb code map
    enc = best_time(lambda: codec.encode(x), repeats, dev)
    decode(payload, device=dev)
    dec = best_time(lambda: decode(payload, device=dev), repeats, dev)
    acc = torch.zeros(numel, device=dev)
    decode_into(payload, acc)
    dec_into = best_time(lambda: decode_into(payload, acc), repeats, dev)
    gb = numel * 4 / 1e9
    return {
        "codec": spec,
        "dist": dist,
        "numel": numel,
        "device": str(x.device),
        "threads": torch.get_num_threads(),
        "payload_bytes": len(payload),
        "ratio": round(numel * 4 / len(payload), 3),
        "encode_gbps": round(gb / enc, 3),
        "decode_gbps": round(gb / dec, 3),
        "decode_into_gbps": round(gb / dec_into, 3),
        "rel_l2_error": round(rel(decode(payload, device=dev), x), 6),
        "ef_numel": ef_numel,
        "ef_rel_error_100": round(ef_error(spec, dist, ef_numel, 100, True, dev), 6),
        "noef_rel_error_100": round(ef_error(spec, dist, ef_numel, 100, False, dev), 6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--ef-numel", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (work and timing there)")
    parser.add_argument("--quick", action="store_true", help="2M elements, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.numel, args.repeats, args.ef_numel = 2_000_000, 1, 100_000
    gen = torch.Generator().manual_seed(0)
    for dist in ("normal", "student_t2"):
        x = sample(dist, args.numel, gen).to(args.device)
        for spec in args.codecs.split(","):
            print(
                json.dumps(run(spec, dist, x, args.repeats, min(args.ef_numel, args.numel))),
                flush=True,
            )


if __name__ == "__main__":
    main()
