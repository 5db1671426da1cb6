"""Train with PyTorch Lightning: configure_optimizers returns a SwarmOptimizer.

    pip install lightning
    python examples/lightning_trainer.py                                  # first peer
    python examples/lightning_trainer.py --initial-peers 127.0.0.1:PORT   # more peers

Lightning calls ``optimizer.step(closure)`` and the LR scheduler itself; with the optimizer wrapped
in :class:`swarm.optim.SwarmOptimizer`, that call is the swarm step, so nothing else in the
LightningModule changes. Offline: the data is a fixed random regression task made here.
"""

from __future__ import annotations

import argparse
import logging

import lightning as L
import torch
from torch import nn

from swarm.optim import SwarmOptimizer


def make_data(items: int = 4096, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(items, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w))


class Regressor(L.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> dict:
        a = self.args
        inner = torch.optim.AdamW(self.parameters(), lr=a.lr)
        self.swarm_optimizer = SwarmOptimizer(
            inner,
            model=self,
            samples_per_step=a.batch,
            run_id="lightning-example",
            initial_peers=a.initial_peers,
            listen=a.listen,
            inner_steps=a.inner_steps,
            matchmaking_timeout_s=a.matchmaking_timeout,
        )
        print(f"peer listening on {self.swarm_optimizer.swarm.address}", flush=True)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.swarm_optimizer, a.max_steps)
        return {
            "optimizer": self.swarm_optimizer,
            "lr_scheduler": {"scheduler": schedule, "interval": "step"},
        }

    def on_train_end(self) -> None:
        self.swarm_optimizer.wait_round()  # the last round runs in the background: land it
        self.swarm_optimizer.close()


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
    p.add_argument("--lr", type=float, default=3e-3, help="inner (AdamW) learning rate, cosine")
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
    loader = torch.utils.data.DataLoader(make_data(), batch_size=args.batch, shuffle=True)
    module = Regressor(args)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    opt = module.swarm_optimizer
    print(
        f"steps {opt.swarm.engine.step_count} rounds {opt.swarm.round} "
        f"first loss {module.losses[0]:.4f} last loss {sum(module.losses[-10:]) / 10:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
