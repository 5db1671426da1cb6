"""A short digest of tensors' exact bits, so that a group can tell whether its members already
hold the same values (sans-I/O).

A group that would sync its members' anchors (``sync=`` of :meth:`Averager.average`) skips it
when every member joined with the same digest: the sync would move nothing but quantization
noise. So does a round of values asked ``unless_equal`` (``average_parameters()``). A member
may lie about its digest as about its values; the worst it buys is a sync or a round skipped,
or run for nothing. SHA-256 of the float32 bytes (about 1 GB/s on one core; tensors off the CPU
are copied over in blocks, so no buffer the size of the tensors is needed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

DIGEST_BYTES = 16
_BLOCK = 1 << 22  # values per copy from another device


@torch.no_grad()
def state_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """:data:`DIGEST_BYTES` bytes of SHA-256 over the tensors as float32, in order (the same
    bits give the same digest on every device). Run it off the event loop."""
    h = hashlib.sha256(b"swarm/state-digest/v1")
    for t in tensors:
        flat = t.detach().reshape(-1)
        h.update(f"|{flat.numel()}|".encode())
        for start in range(0, flat.numel(), _BLOCK):
            block = flat[start : start + _BLOCK].to("cpu", torch.float32).contiguous()
            h.update(memoryview(block.numpy()).cast("B"))
    return h.digest()[:DIGEST_BYTES]
