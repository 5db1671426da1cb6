"""Error feedback of one averager, over slices of the flat vector.

:class:`swarm.compression.ErrorFeedback` keeps one residual per fixed-size tensor; an all-reduce
encodes chunks whose boundaries move with the group (sizes follow bandwidth), so the residuals are
kept over the flat vector instead and indexed by absolute position:

- the *sender* residual covers the whole vector (each chunk a peer sends to an owner);
- the *owner* residual covers the part this peer owned last (the averaged part it sends back);
  it belongs to a range, not to a peer: when the owned range moves (part sizes follow measured
  bandwidth), what it holds where the old range and the new overlap is kept, the rest dropped. With
  ``turning`` (the part layout turns with every group, as update scoring wants) it covers the
  whole vector instead, so what a range's owner left out waits until this peer owns it again.

Lossless codecs (``none``) keep no residual. The owner applies to its own part exactly what it
sends (``D(C(avg + r))``), so every member ends the round with the same values.

Rounds of values (``keep=False``: anchor syncs, ``average_parameters``; always in a dense codec)
keep no residual: their averages replace the values instead of adding up, so what one round
rounded off is not owed to the next. Carried over, it moved some parts by a rounding's size
and not others (members whose values agreed closely saw such parts 0.3-1.5% off their own
values and the others 0.04-0.16%, and accused honest owners).

Residuals are stored in bfloat16 (:data:`RESIDUAL_DTYPE`): they are state kept across rounds,
one vector for the sender and up to one more for a turning owner, and a 1B-parameter model's
float32 residual alone is 4 GB. Each chunk is summed and encoded in float32 (a chunk-sized
buffer), and only what the payload failed to carry is rounded to bfloat16 (8 significant bits),
so the error of the error is under 0.4% of a residual that is itself what a codec left out.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from swarm.compression import Codec
from swarm.compression.feedback import encode_keeping_error
from swarm.errors import CompressionError

LOSSLESS = ("none",)
RESIDUAL_DTYPE = torch.bfloat16


class FlatFeedback:
    """Residuals for encoding slices of one flat float32 vector of ``numel`` elements, kept on
    the vector's ``device``; with ``keep=False`` none (every slice is encoded as it is, and an
    owner still applies what it sends)."""

    def __init__(
        self,
        codec: Codec,
        numel: int,
        device: torch.device | str = "cpu",
        turning: bool = False,
        keep: bool = True,
    ):
        self.codec = codec
        self.turning = turning
        self.numel = numel
        self.device = torch.device(device)
        self.enabled = keep and codec.name not in LOSSLESS
        self._sender: torch.Tensor | None = None
        self._owner: torch.Tensor | None = None
        self._owner_range: tuple[int, int] = (0, 0)
        self._owner_wanted: tuple[int, int] | None = None  # the range prepare_owner() gave
        self._whole: torch.Tensor | None = None  # the owner residual of a turning layout
        self._creating = threading.Lock()

    def encode(self, values: torch.Tensor, start: int) -> bytes:
        """Encode a sender chunk ``values`` (= flat[start:start+n]) with its residual."""
        if not self.enabled:
            return self.codec.encode(values)
        r = self._sender_residual()[start : start + values.numel()]
        return _encode_with(self.codec, values, r)

    def encode_again(self, values: torch.Tensor, start: int) -> bytes:
        """Encode a sender chunk whose earlier payload its owner discarded (a retry), as if
        this were its first: what the residual held there before is lost (a small, one-off
        loss of compensation), and the discarded payload's error is not counted twice."""
        if self.enabled:
            self._sender_residual()[start : start + values.numel()].zero_()
        return self.encode(values, start)

    def _sender_residual(self) -> torch.Tensor:
        # the first chunks of several parts encode at once, in worker threads: without the
        # lock each made a residual of its own (one more vector of memory for a moment, and the
        # losers' errors lost)
        with self._creating:
            if self._sender is None:
                self._sender = self._zeros(self.numel)
            return self._sender

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=RESIDUAL_DTYPE, device=self.device)

    def prepare_owner(self, start: int, end: int) -> None:
        """Own ``[start, end)`` from now on. The residual of the range owned before is kept
        where the two overlap (what this owner left out there is still its to send) and
        dropped elsewhere; the buffer is made by the first :meth:`encode_owned`, in a worker."""
        if self.enabled:
            self._owner_wanted = (start, end)

    def encode_owned(self, values: torch.Tensor, offset: int) -> bytes:
        """Encode an averaged chunk and overwrite ``values`` with what receivers will decode.

        ``offset`` is relative to the range given to :meth:`prepare_owner`.
        """
        if self.codec.name in LOSSLESS:
            return self.codec.encode(values)
        if not self.enabled:  # a round of values keeps nothing, and applies what it sends
            return encode_keeping_error(self.codec, values.clone(), decoded=values)
        r = self._owner_residual()[offset : offset + values.numel()]
        return _encode_with(self.codec, values, r, decoded=values)

    def _owner_residual(self) -> torch.Tensor:
        with self._creating:
            if self._owner_wanted is None:
                raise CompressionError("prepare_owner() must come before encode_owned()")
            start, end = self._owner_wanted
            if self.turning:
                if self._whole is None:
                    self._whole = self._zeros(self.numel)
                self._owner, self._owner_range = self._whole[start:end], (start, end)
            elif self._owner is None or self._owner_range != (start, end):
                moved = self._zeros(end - start)
                if self._owner is not None:  # keep the overlap of the old range and the new
                    was = self._owner_range[0]
                    lo, hi = max(start, was), min(end, self._owner_range[1])
                    if lo < hi:
                        moved[lo - start : hi - start].copy_(self._owner[lo - was : hi - was])
                self._owner, self._owner_range = moved, (start, end)
            return self._owner

    def forget_owned(self, offset: int, n: int) -> None:
        """Clear the owner residual of ``n`` elements from ``offset``: what :meth:`encode_owned`
        sent there was discarded by its receivers (the part was retried), so the error it
        accounted for never happened; the previous residual is lost with it (a small, one-off
        loss of compensation, never a wrong value)."""
        if self._owner is not None and self._owner_range == self._owner_wanted:
            self._owner[offset : offset + n].zero_()

    def unsent(self) -> torch.Tensor | None:
        """The sender residual itself (flat, :data:`RESIDUAL_DTYPE`): what this peer's payloads
        left out of its values, which its next round adds back unless the caller takes it (see
        ``RoundResult.unsent``); None without error feedback or before any encoding."""
        return self._sender if self.enabled else None

    def drop_sent(self, ranges: list[tuple[int, int]]) -> None:
        """Clear the sender residual in ``ranges`` (``(start, end)`` of the flat vector): parts
        that kept this peer's own values applied all of them there, so nothing is owed (what
        an earlier round left out there is lost: a one-off loss, never a value counted twice)."""
        if self._sender is not None:
            for start, end in ranges:
                self._sender[start:end].zero_()

    def state_dict(self) -> dict[str, Any]:
        sender = self._sender.cpu() if self._sender is not None else None  # portable checkpoints
        return {"codec": self.codec.spec, "sender": sender}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sender residual (ignored when the codec or size differs)."""
        saved = state.get("sender") if isinstance(state, dict) else None
        if state.get("codec") != self.codec.spec or not isinstance(saved, torch.Tensor):
            return
        if saved.numel() == self.numel and saved.is_floating_point():
            self._sender = saved.detach().reshape(-1).to(self.device, RESIDUAL_DTYPE, copy=True)


def _encode_with(
    codec: Codec, values: torch.Tensor, r: torch.Tensor, decoded: torch.Tensor | None = None
) -> bytes:
    """``e = values + r; c = C(e); r <- e - D(c)`` with ``e`` in float32 (``decoded``: also
    write ``D(c)`` there, which may be ``values`` itself); on a codec error r is cleared."""
    # into the codec's scratch (this thread's): a mixed-dtype sum into a new tensor took 3x as
    # long (0.54 against 0.17 ms for 256K values out of cache), its allocation
    e = torch.add(
        values, r, out=codec._scratch("feedback_sum", values.numel(), torch.float32, values.device)
    )
    try:
        return encode_keeping_error(codec, e, decoded=decoded)
    finally:
        r.copy_(e)  # the error left in e, or zeros when the codec refused it
