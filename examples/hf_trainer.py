"""Train with the Hugging Face ``Trainer``: pass a SwarmOptimizer through ``optimizers=``.

    pip install transformers accelerate
    python examples/hf_trainer.py                                  # first peer
    python examples/hf_trainer.py --initial-peers 127.0.0.1:PORT   # more peers, PORT as printed

The Trainer calls ``optimizer.step()`` and the scheduler itself; wrapped in
:class:`swarm.optim.SwarmOptimizer`, that call is the swarm step. The model is a small classifier
written here (no weights are downloaded); the data is a fixed random task made here.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from torch import nn
from transformers import Trainer, TrainingArguments, get_cosine_schedule_with_warmup

from swarm.optim import SwarmOptimizer


class Classifier(nn.Module):
    """Returns ``{"loss", "logits"}`` from ``labels``, as the Trainer expects of a model."""

    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, classes))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Items(torch.utils.data.Dataset):
    def __init__(self, items: int = 4096, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(items, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "labels": self.y[i]}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
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
        help="address to bind; 0.0.0.0:31415 to be reachable from other machines",
    )
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    p.add_argument("--batch", type=int, default=64, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="inner (AdamW) learning rate")
    p.add_argument("--inner-steps", type=int, default=50, help="local steps between rounds")
    p.add_argument(
        "--matchmaking-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long a round looks for partners (a lone peer waits this long)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = Classifier()
    optimizer = SwarmOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        model=model,
        samples_per_step=args.batch,
        run_id="hf-trainer-example",
        initial_peers=args.initial_peers,
        listen=args.listen,
        inner_steps=args.inner_steps,
        matchmaking_timeout_s=args.matchmaking_timeout,
    )
    print(f"peer listening on {optimizer.swarm.address}", flush=True)
    schedule = get_cosine_schedule_with_warmup(optimizer, args.max_steps // 10, args.max_steps)
    with optimizer, tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch,
            logging_steps=args.inner_steps,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=Items(),
            optimizers=(optimizer, schedule),
        )
        result = trainer.train()
        optimizer.wait_round()  # the last round runs in the background: land it
        print(
            f"steps {optimizer.swarm.engine.step_count} rounds {optimizer.swarm.round} "
            f"train loss {result.training_loss:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
