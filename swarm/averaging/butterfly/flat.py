"""The tensors of a round laid end to end: one flat float32 vector and a staging buffer.

Memory per round beyond the tensors, on the tensors' device: the staging buffer the size of the
tensors, plus a float32 copy of them unless they are a single contiguous float32 tensor (then it
is read in place); both are reused across rounds of the same size.
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
    """Reused flat buffers for the rounds of one averager (run its methods in a worker thread)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def gather(self, tensors: list[torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's values as one flat float32 vector on the tensors' device, and the staging
        buffer. Tensors spread over several devices gather on the first one's."""
        device = tensors[0].device if tensors else torch.device("cpu")
        if self._result is None or self._result.numel() != numel or self._result.device != device:
            self._result = torch.empty(numel, dtype=torch.float32, device=device)
        single = tensors[0] if len(tensors) == 1 else None
        if single is not None and single.dtype == torch.float32 and single.is_contiguous():
            return single.detach().view(-1), self._result
        if self._flat is None or self._flat.numel() != numel or self._flat.device != device:
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return self._flat, self._result


def scatter(
    tensors: list[torch.Tensor], result: torch.Tensor, ranges: list[tuple[int, int]]
) -> None:
    """Copy ``result[start:end]`` for each range into the tensors (their device and dtype)."""
    bounds, offset = [], 0
    for t in tensors:
        bounds.append((offset, offset + t.numel()))
        offset += t.numel()
    for start, end in ranges:
        for t, (ts, te) in zip(tensors, bounds, strict=True):
            lo, hi = max(start, ts), min(end, te)
            if lo < hi:
                t.detach().view(-1)[lo - ts : hi - ts].copy_(result[lo:hi])
