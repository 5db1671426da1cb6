"""The tensors of a round laid end to end as one flat float32 vector.

Memory beyond the tensors, on their device: a float32 copy of them unless they are a single
contiguous float32 tensor (then it is read in place), reused across rounds of the same size.
The averages wait for their verdict compressed (:mod:`~swarm.averaging.butterfly.staged`).
"""

from __future__ import annotations

import torch

from swarm.errors import AveragingError


def check_tensors(tensors: list[torch.Tensor]) -> None:
    """Raises AveragingError unless every tensor is a contiguous float tensor."""
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise AveragingError("average() takes float tensors")
        if not t.is_contiguous():
            raise AveragingError("average() takes contiguous tensors (use .contiguous())")


class FlatStaging:
    """A reused flat buffer for the rounds of one averager (run its methods in a worker thread)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def gather(self, tensors: list[torch.Tensor], numel: int) -> torch.Tensor:
        """This peer's values as one flat float32 vector on the tensors' device (a single
        contiguous float32 tensor is read in place). Tensors spread over several devices gather
        on the first one's."""
        device = tensors[0].device if tensors else torch.device("cpu")
        single = tensors[0] if len(tensors) == 1 else None
        if single is not None and single.dtype == torch.float32 and single.is_contiguous():
            return single.detach().view(-1)
        if self._flat is None or self._flat.numel() != numel or self._flat.device != device:
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return self._flat


def write_at(tensors: list[torch.Tensor], start: int, values: torch.Tensor) -> None:
    """Copy ``values`` into the tensors (laid end to end) from flat position ``start``, in the
    tensors' device and dtype."""
    end, offset = start + values.numel(), 0
    for t in tensors:
        lo, hi = max(start, offset), min(end, offset + t.numel())
        if lo < hi:
            t.detach().view(-1)[lo - offset : hi - offset].copy_(values[lo - start : hi - start])
        offset += t.numel()
