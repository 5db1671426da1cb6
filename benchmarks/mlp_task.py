"""The churn benchmarks' task: an MLP 784-256-10 on generated, deterministic data (offline).

Ten fixed class prototypes in 784 dimensions; an item is a noisy copy of its class's prototype,
and 10% of the labels are random, so the loss has a floor above 0 (about 0.4-0.5 nats) and an
untrained model starts at ln 10 = 2.30. Every process builds the same data from the same seeds.
"""

from __future__ import annotations

import torch
from torch import nn

DIM, HIDDEN, CLASSES = 784, 256, 10
TEST_ITEMS = 4096
LR, BATCH = 3e-3, 64


def prototypes() -> torch.Tensor:
    return torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0)) * 0.15


def make_data(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` fresh items drawn from ``g`` (a stream: no item repeats, so no overfitting)."""
    labels = torch.randint(CLASSES, (n,), generator=g)
    x = PROTOTYPES[labels] + torch.randn(n, DIM, generator=g)
    noisy = torch.rand(n, generator=g) < 0.1
    return x, torch.where(noisy, torch.randint(CLASSES, (n,), generator=g), labels)


PROTOTYPES = prototypes()


def test_set() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(TEST_ITEMS, torch.Generator().manual_seed(10**6))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR)


def evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(data[0]), data[1]).item()
