"""The tensors of a round laid end to end as one flat float32 vector.

Memory beyond the tensors, on their device: a float32 copy of them unless they lie end to end
in one float32 storage (then they are read in place), reused across rounds of the same size,
and for ``none`` rounds a float32 buffer of the same size that the averages are decoded into;
under compressing codecs they wait for their verdict compressed
(:mod:`~swarm.averaging.butterfly.staged`).
"""

from __future__ import annotations

import threading

import torch

from swarm.errors import AveragingError


def check_tensors(tensors: list[torch.Tensor]) -> None:
    """Raises AveragingError unless every tensor is a contiguous float tensor."""
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise AveragingError("average() takes float tensors")
        if not t.is_contiguous():
            raise AveragingError("average() takes contiguous tensors (use .contiguous())")


def laid_end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one flat float32 view of their storage when they lie end to end in it
    (each contiguous float32, each starting where the one before ends), else None."""
    if not tensors or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    first = tensors[0].detach()
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,))


class FlatStaging:
    """A reused flat buffer for the rounds of one averager (run its methods in a worker thread)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def result(self, numel: int, device: torch.device) -> torch.Tensor:
        """A reused float32 buffer of ``numel`` values on ``device``, for averages decoded on
        arrival (see :func:`~swarm.averaging.butterfly.staged.stage_decoded`)."""
        if self._result is None or self._result.numel() != numel or self._result.device != device:
            self._result = torch.empty(numel, dtype=torch.float32, device=device)
        return self._result

    def gather(self, tensors: list[torch.Tensor], numel: int) -> tuple[torch.Tensor, bool]:
        """This peer's values as one flat float32 vector on the tensors' device, and whether it
        is the tensors' own storage: tensors laid end to end in one storage (a single contiguous
        float32 tensor, or views of one buffer like the training slots) are read and written in
        place, others copied into a reused buffer. Tensors spread over several devices gather
        on the first one's."""
        device = tensors[0].device if tensors else torch.device("cpu")
        in_place = laid_end_to_end(tensors)
        if in_place is not None:
            self._flat = None  # the layout may have changed: no copy kept for nothing
            return in_place, True
        if self._flat is None or self._flat.numel() != numel or self._flat.device != device:
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
        offset = 0
        for t in tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return self._flat, False


def write_at(tensors: list[torch.Tensor], start: int, values: torch.Tensor) -> None:
    """Copy ``values`` into the tensors (laid end to end) from flat position ``start``, in the
    tensors' device and dtype."""
    end, offset = start + values.numel(), 0
    for t in tensors:
        lo, hi = max(start, offset), min(end, offset + t.numel())
        if lo < hi:
            t.detach().view(-1)[lo - offset : hi - offset].copy_(values[lo - start : hi - start])
        offset += t.numel()


class ScratchRows:
    """One reused float32 row per worker thread, on ``device``, for chunk-sized work whose result
    is kept nowhere (a chunk decoded to be measured or checked)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()

    def row(self, numel: int) -> torch.Tensor:
        """This thread's row, ``numel`` values long (grown when a longer one is asked for)."""
        row = getattr(self._local, "row", None)
        if row is None or row.numel() < numel:
            row = self._local.row = torch.empty(numel, dtype=torch.float32, device=self.device)
        return row[:numel]
