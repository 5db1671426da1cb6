"""The task of ``convergence.py``: a small CNN with BatchNorm on an endless stream of images.

Each sample is one of 10 fixed class patterns (3x16x16), shifted by a random offset of up to
``SHIFT`` pixels each way, under Gaussian noise, with ``LABEL_NOISE`` of the labels drawn at
random. Every peer draws fresh samples at every step from its own generator, so no
configuration can memorize a training set: the test loss measures optimization, not
overfitting, and it has a floor above zero (the random labels). The test set is a fixed draw
from the same distribution.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE, CLASSES = 16, 10
SHIFT = 3  # pixels, each way
NOISE = 2.5  # std of the pixel noise; the class patterns have std 1
LABEL_NOISE = 0.1  # share of random labels


def _patterns() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)  # the class patterns are the task: one for all
    smooth = nn.functional.avg_pool2d(
        torch.randn(CLASSES, 3, IMAGE + 2, IMAGE + 2, generator=g), 3, stride=1
    )
    return smooth / smooth.std()


PATTERNS = _patterns()


def sample(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` fresh samples drawn with ``g``: (images, labels)."""
    labels = torch.randint(CLASSES, (n,), generator=g)
    images = PATTERNS[labels]
    dx, dy = torch.randint(-SHIFT, SHIFT + 1, (2, n), generator=g)
    images = torch.stack(
        [
            torch.roll(im, (int(y), int(x)), dims=(1, 2))
            for im, x, y in zip(images, dx, dy, strict=True)
        ]
    )
    images = images + NOISE * torch.randn(images.shape, generator=g)
    noisy = torch.rand(n, generator=g) < LABEL_NOISE
    return images, torch.where(noisy, torch.randint(CLASSES, (n,), generator=g), labels)


def test_set(n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out draw every configuration is evaluated on."""
    return sample(n, torch.Generator().manual_seed(987654321))


def make_model(seed: int = 0) -> nn.Module:
    """The same initial weights on every peer of a run (as after a swarm's first download)."""
    torch.manual_seed(seed)

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


@torch.no_grad()
def evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Test loss with the model's own running statistics (eval mode), as a user would."""
    was_training = model.training
    model.eval()
    try:
        return nn.functional.cross_entropy(model(data[0]), data[1]).item()
    finally:
        model.train(was_training)
