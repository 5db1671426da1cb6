"""Which tensors of a model the swarm averages, and the schema hash that keeps models apart.

Every parameter is averaged (frozen ones too, so all peers keep one model) and so is every
floating-point buffer (BatchNorm running mean/var) when the codec is dense (none, fp16, bf16,
int8). Top-K and 1-bit codecs turn a running variance's change into something that can make it
negative for a round (measured: the evaluation loss explodes), so with them buffers stay local
to each peer (they are statistics each peer re-estimates from its own batches) until
``average_parameters()``, which averages them in a dense codec (:mod:`.final_average`).
Integer buffers such as ``num_batches_tracked`` are counters, not state to average; they stay
local.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from swarm.errors import TrainingError


def piece(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements ``start:end`` of ``t`` flattened, as a view: ``t`` itself when that is all of
    it (any layout, its own shape), else a 1-D slice (``t`` must then be contiguous)."""
    return t if (start, end) == (0, t.numel()) else t.view(-1)[start:end]


@dataclass(frozen=True)
class ModelTensors:
    """Named views of a model's averaged tensors (the model's own storage, not copies)."""

    param_names: tuple[str, ...]  # parameter names, in ``named_parameters()`` order
    params: tuple[torch.Tensor, ...]  # parameters (leaf tensors with .grad)
    buffer_names: tuple[str, ...]  # floating buffer names
    buffers: tuple[torch.Tensor, ...]  # floating buffers, updated in place

    @classmethod
    def of(cls, model: torch.nn.Module, *, with_buffers: bool = True) -> ModelTensors:
        """The averaged tensors of ``model``; ``with_buffers=False`` leaves buffers local."""
        named = list(model.named_parameters())
        if not named:
            raise TrainingError("the model has no parameters to train")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise TrainingError(f"the model spans several devices {sorted(map(str, devices))}")
        floating = [
            (n, b) for n, b in model.named_buffers() if b.is_floating_point() and with_buffers
        ]
        return cls(
            tuple(n for n, _ in named),
            tuple(p for _, p in named),
            tuple(n for n, _ in floating),
            tuple(b for _, b in floating),
        )

    def pieces(self, pieces: tuple[tuple[int, int, int], ...]) -> ModelTensors:
        """Views of pieces of the tensors: ``(index into all, start, end)`` of each flattened
        tensor, in the order of ``all`` (a whole tensor keeps its shape; a cut one must be
        contiguous). Writing to a view writes to the model."""
        n, views = len(self.params), []
        for i, start, end in pieces:
            name, t = self.names[i], self.all[i].detach()
            whole = (start, end) == (0, t.numel())
            views.append((name if whole else f"{name}[{start}:{end}]", piece(t, start, end)))
        params = [v for (i, _, _), v in zip(pieces, views, strict=True) if i < n]
        buffers = [v for (i, _, _), v in zip(pieces, views, strict=True) if i >= n]
        return ModelTensors(
            tuple(name for name, _ in params),
            tuple(t for _, t in params),
            tuple(name for name, _ in buffers),
            tuple(t for _, t in buffers),
        )

    @property
    def all(self) -> tuple[torch.Tensor, ...]:
        return self.params + self.buffers

    @property
    def names(self) -> tuple[str, ...]:
        return self.param_names + self.buffer_names

    @property
    def device(self) -> torch.device:
        return self.all[0].device

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.all)

    def schema_hash(self) -> str:
        """Hex digest of names, shapes and dtypes: peers with different models never mix."""
        h = hashlib.sha256()
        for name, t in zip(self.names, self.all, strict=True):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        return h.hexdigest()[:32]
