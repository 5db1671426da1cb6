"""Train an image classifier (a small CNN with BatchNorm) with a swarm: a script to adapt.

On one machine (the default --listen 127.0.0.1:0 keeps the peer on this machine, any free port):
    python examples/image_classifier.py
    python examples/image_classifier.py --initial-peers 127.0.0.1:PORT   # PORT as printed
Across machines (forward port 31415 on a router; add --announce PUBLIC_IP:31415 behind one):
    first machine:   python examples/image_classifier.py --listen 0.0.0.0:31415
    other machines:  python examples/image_classifier.py --initial-peers FIRST_HOST:31415

--identity and --swarm-key (or SWARM_KEY_FILE / SWARM_KEY) work as for ``swarm-peer``. With
torchvision installed, ``--data cifar10 --data-dir DIR`` trains on CIFAR-10 (already downloaded
into DIR: nothing is fetched here); without it, a small synthetic image set is made locally
(``--data synthetic``, the default, also used by the tests). Checkpoints go to ``--checkpoint``
after every round and are resumed from when present.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn

from swarm.api import Swarm
from swarm.cli import describe_membership, load_membership
from swarm.compression import get_codec
from swarm.errors import SwarmError


def synthetic_images(n: int, size: int = 16, classes: int = 10, seed: int = 0):
    """Each class is a fixed random pattern; samples are noisy, shifted copies of it."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, size, size, generator=g)
    labels = torch.randint(classes, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 3, size, size, generator=g)
    shifts = torch.randint(-2, 3, (n,), generator=g)
    images = torch.stack([im.roll(int(s), dims=2) for im, s in zip(images, shifts, strict=True)])
    return torch.utils.data.TensorDataset(images, labels)


def load_dataset(name: str, data_dir: str) -> torch.utils.data.Dataset:
    if name == "synthetic":
        return synthetic_images(4096)
    try:
        import torchvision  # optional: only for real datasets
    except ImportError as e:
        raise SystemExit("--data cifar10 needs torchvision (pip install torchvision)") from e
    transform = torchvision.transforms.Compose(
        [
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)),
        ]
    )
    return torchvision.datasets.CIFAR10(data_dir, train=True, download=False, transform=transform)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, 16), block(16, 32))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def codec_spec(text: str) -> str:
    """argparse type: a codec name swarm knows (one-line error otherwise)."""
    try:
        get_codec(text)
    except SwarmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def fail(error: Exception) -> NoReturn:
    print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="HOST:PORT",
        help="live peers to join through; none starts a new swarm",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address to bind (UDP and TCP); 0.0.0.0:31415 to be reachable",
    )
    p.add_argument(
        "--announce",
        default=None,
        metavar="HOST:PORT",
        help="address others dial, e.g. your router's public one",
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("SWARM_IDENTITY"),
        metavar="PATH",
        help="key file, created with mode 0600 when missing (env SWARM_IDENTITY)",
    )
    p.add_argument(
        "--swarm-key",
        default=os.environ.get("SWARM_KEY_FILE"),
        metavar="PATH",
        help="file holding the swarm key (env SWARM_KEY_FILE, or the key itself "
        "in SWARM_KEY); none: an open swarm",
    )
    p.add_argument("--run-id", default="image-classifier", help="name of the training run")
    p.add_argument(
        "--data",
        choices=["synthetic", "cifar10"],
        default="synthetic",
        help="data set (cifar10 needs torchvision and the files in --data-dir)",
    )
    p.add_argument("--data-dir", default="data", help="folder holding CIFAR-10")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over this peer's shard")
    p.add_argument("--batch", type=positive_int, default=64, help="images per step")
    p.add_argument(
        "--inner-steps", type=positive_int, default=20, help="local steps between averaging rounds"
    )
    p.add_argument(
        "--codec",
        type=codec_spec,
        default="int8",
        help="compression: none, fp16, bf16, int8, sparse (home uplinks), topk:0.01, 1bit, ...",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="saved after every round, resumed from when present",
    )
    p.add_argument(
        "--max-steps", type=positive_int, default=None, help="stop after this many steps"
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    try:
        membership = load_membership(args.swarm_key)
    except SwarmError as e:
        fail(e)
    print(describe_membership(membership), flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"

    dataset = load_dataset(args.data, args.data_dir)
    model = SmallCNN().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    try:
        swarm = Swarm(
            model,
            optimizer,
            run_id=args.run_id,
            initial_peers=args.initial_peers,
            listen=args.listen,
            announce=args.announce,
            identity_path=args.identity,
            membership=membership,
            inner_steps=args.inner_steps,
            codec=args.codec,
        )
    except SwarmError as e:  # a bad address, key file or option: one line, no traceback
        fail(e)
    with swarm:
        print(f"peer listening on {swarm.address}", flush=True)
        watch = f"--initial-peers {swarm.address} --run-id {args.run_id}"
        print(f"watch the run: swarm-peer dashboard {watch}  (or: swarm-peer status {watch})")
        if args.checkpoint and os.path.exists(args.checkpoint):
            swarm.load(args.checkpoint)
            print(f"resumed from {args.checkpoint} at round {swarm.round}", flush=True)
        steps, report = 0, None
        for _epoch in range(args.epochs):
            # Recomputed each epoch: this peer's disjoint share of the data among live peers.
            shard = torch.utils.data.Subset(dataset, swarm.shard(len(dataset)))
            loader = torch.utils.data.DataLoader(
                shard, batch_size=args.batch, shuffle=True, drop_last=True
            )
            for images, labels in loader:
                images, labels = images.to(device), labels.to(device)
                loss = nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                # replaces optimizer.step(); the loss is optional, for status and dashboard
                report = swarm.step(samples=len(labels), loss=loss.detach())
                optimizer.zero_grad(set_to_none=True)
                steps += 1
                if report.round_due:
                    print(report.line(loss.item()), flush=True)
                    if args.checkpoint:
                        swarm.save(args.checkpoint)
                if args.max_steps and steps >= args.max_steps:
                    break
            if args.max_steps and steps >= args.max_steps:
                break
        if report is not None:
            print(
                f"summary: {steps} steps, {swarm.round} rounds, last loss {loss.item():.4f}, "
                f"utilization {report.utilization:.0%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
