"""An owner's replies to its senders (swarm.averaging.butterfly.replies): every reply carries
every averaged chunk, and each chunk's payload is let go once its readers wrote it."""

from __future__ import annotations

import asyncio
import weakref

from swarm.averaging.butterfly.outcome import PartOutcome
from swarm.averaging.butterfly.replies import PartReplies


class _Reply:
    """A reply stream that records what was written on it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.trailer: dict | None = None

    async def write(self, payload: memoryview) -> None:
        await asyncio.sleep(0)
        self.written.append(bytes(payload))  # a copy: the payload itself may be let go

    def set_trailer(self, trailer: dict) -> None:
        self.trailer = trailer


class _BufferedReply(_Reply):
    """A reply whose writes go into the socket's buffer at once (no wait on the loop)."""

    async def write(self, payload: memoryview) -> None:
        self.written.append(bytes(payload))


async def _hold() -> None:
    await asyncio.sleep(3600)


async def test_each_chunk_is_let_go_once_every_reply_that_carries_it_wrote_it() -> None:
    replies = PartReplies(chunks=3, hold=_hold)
    replies.new_attempt()
    early, late = _Reply(), _Reply()
    writers = [replies.start(early, 0)]
    payloads = [memoryview(bytes([i]) * 8) for i in range(3)]  # a weak reference follows them
    refs = [weakref.ref(p) for p in payloads]
    replies.publish(0, payloads[0], readers=(0, 1))
    await asyncio.sleep(0.01)
    assert early.written == [bytes(payloads[0])]
    # a sender whose reply started after the chunk went out (it delivered the chunk while its
    # reply was being prepared) still gets it: it was counted as a reader
    writers.append(replies.start(late, 1))
    for i in (1, 2):
        replies.publish(i, payloads[i], readers=(0, 1))
    del payloads
    replies.resolve(0, PartOutcome.OK, (0, 1, 2))
    await asyncio.gather(
        *(replies.finish(r, w, 0) for r, w in zip((early, late), writers, strict=True))
    )
    assert [len(r.written) for r in (early, late)] == [3, 3]
    assert early.trailer == late.trailer == {"ok": True, "c": [0, 1, 2]}
    assert early.written == late.written == [bytes([i]) * 8 for i in range(3)]
    assert all(ref() is None for ref in refs)  # the owner no longer holds them


async def test_a_dropped_senders_writer_gets_no_chunk_and_takes_none_from_the_others() -> None:
    """Sender 2 was dropped as chunk 0 was averaged without it, but its writer woke before it
    was stopped: it gets nothing, and senders 0 and 1, the chunk's readers, still get it. A
    count of readers let the dropped writer take a slot, and the last honest reply ended
    without the chunk (its member kept its own values for the part)."""
    replies = PartReplies(chunks=1, hold=_hold)
    replies.new_attempt()
    dropped, first, second = _BufferedReply(), _BufferedReply(), _BufferedReply()
    # the dropped writer first: it is the one that would take the chunk from the last reader
    writers = [replies.start(dropped, 2), replies.start(first, 0), replies.start(second, 1)]
    replies.publish(0, b"average", readers=(0, 1))
    done = await asyncio.gather(*writers)
    assert done == [False, True, True]
    assert dropped.written == [] and first.written == second.written == [b"average"]
