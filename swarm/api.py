"""``Swarm(model, optimizer).step()``: train with the swarm by changing two lines of a script.

Two classes with the same methods: :class:`Swarm` (synchronous; owns one asyncio loop in a daemon
thread) and :class:`AsyncSwarm` (``await``; runs on the caller's loop)::

    with Swarm(model, optimizer, run_id="my-run", initial_peers=["1.2.3.4:7000"]) as swarm:
        for batch in data:
            loss = model(batch).mean()
            loss.backward()
            swarm.step(samples=len(batch))   # instead of optimizer.step()
            optimizer.zero_grad()            # step() does NOT zero gradients, as optimizer.step()

With ``diloco`` a due round runs in the background while the next inner steps go on (``overlap``,
the default): ``step()`` returns at once and the round lands at a later step, waiting only when
the next round is due before the last one finished. With ``overlap=False`` (and in
``local_sgd``/``gradients``) ``step()`` blocks for the whole round; every report carries the
compute utilization.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from swarm.config import SwarmConfig
from swarm.config_sources import facade_config
from swarm.errors import SwarmError, TrainingError
from swarm.monitor.tracker import RoundFigures
from swarm.net.record import PeerRecord
from swarm.training.cadence import RoundLookout
from swarm.training.checkpoint import read_checkpoint, write_checkpoint
from swarm.training.driver import AwaitingRounds, BlockingRounds, Rounds, drive, run_inline
from swarm.training.engine import TrainingEngine
from swarm.training.final_average import average_values
from swarm.training.joining import Joined, join_swarm
from swarm.training.overlap import RoundHandle
from swarm.training.report import StepReport
from swarm.training.rounds import RoundOutcome, RoundPlan, outcome_of
from swarm.training.sharding import my_items
from swarm.training.transfer import STATE_STREAM, StateProvider

if TYPE_CHECKING:
    from swarm.averaging import Averager
    from swarm.identity import PeerID
    from swarm.peer import Peer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncSwarm:
    """The asyncio twin of :class:`Swarm`; same arguments, same methods, awaited.

    Create with ``swarm = await AsyncSwarm.create(model, optimizer, ...)`` or
    ``async with AsyncSwarm(model, optimizer, ...) as swarm``.

    An overlapped round is a task on the caller's loop: it moves on while the loop runs (each
    ``await swarm.step()`` gives it one turn), so a script that awaits its data or sleeps between
    steps hides the round best; a purely compute-bound loop waits for it at the next due round.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        config: SwarmConfig | None = None,
        **options: Any,
    ):
        self.config = facade_config(model, config, options)
        self.model = model
        self.optimizer = optimizer
        self.engine = TrainingEngine(model, optimizer, self.config)
        self.peer: Peer | None = None  # set by start()
        self.averager: Averager | None = None  # set by start()
        self._provider = StateProvider(self.engine)
        self._rounds: set[asyncio.Task[RoundOutcome]] = set()  # rounds running in the background
        self._awaiting = AwaitingRounds(self.average_round, self.start_round)
        self._lookout = RoundLookout()
        self.joined: Joined | None = None  # the state adopted on joining, and refused providers

    @classmethod
    async def create(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
    ) -> AsyncSwarm:
        swarm = cls(model, optimizer, **kwargs)
        await swarm.start()
        return swarm

    async def __aenter__(self) -> AsyncSwarm:
        if self.peer is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Join the swarm, then (late joiner) download the current state before training."""
        from swarm.averaging import Averager  # the averaging layer imports the network stack
        from swarm.peer import Peer

        cfg = self.config
        self.peer = await Peer.start(cfg.peer)
        self.peer.progress.attach(self.engine, cfg.averaging.codec)
        try:
            self.peer.transport.add_stream(STATE_STREAM, self._provider.handle)
            self.averager = Averager(self.peer, cfg.averaging)
            self._provider.order = self._round_order
            if not cfg.peer.initial_peers:
                self.engine.offer_from_round = 0  # this peer starts the swarm: its state is it
            elif cfg.sync_on_join:
                await self._join()
            else:
                self.engine.offer_from_round = self.engine.round + 1  # once trained
        except BaseException:
            await self.close()
            raise

    def _round_order(self) -> int | None:
        """The round order this peer plans groups with (None once closed), for joiners."""
        return self.averager.order if self.averager is not None else None

    async def _join(self) -> None:
        self.joined = await join_swarm(self.peer, self.engine, self.config)
        if self.joined and self.joined.order is not None and self.averager is not None:
            self.averager.adopt_order(self.joined.order, base=self.engine.round)

    async def average_round(self, plan: RoundPlan) -> RoundOutcome:
        """Run one averaging round on ``plan.tensors`` (in place); never raises on failure."""
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(
                self.averager.average(plan.tensors, **plan.averaging_options()),
                self.config.averaging.round_timeout_s,
            )
        except (SwarmError, OSError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                limit = self.config.averaging.round_timeout_s
                reason = f"the round ran past round_timeout_s ({limit:g} s)"
            else:
                reason = f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - started
            self.peer.record_round(RoundFigures(False, reason, "", 0, 0, 0, seconds, seconds, 0.0))
            return RoundOutcome.failed(reason, round_s=_since(plan))
        self.peer.record_round(result.figures(time.perf_counter() - started))
        return dataclasses.replace(outcome_of(result), round_s=_since(plan))

    def start_round(self, plan: RoundPlan) -> RoundHandle:
        """Start :meth:`average_round` as a task on this loop (an overlapped round)."""
        task = asyncio.ensure_future(self.average_round(plan))
        self._rounds.add(task)
        task.add_done_callback(self._rounds.discard)
        return task

    async def step(self, samples: float | None = None, loss: Any = None) -> StepReport:
        """Use instead of ``optimizer.step()``; does not zero gradients.

        Args:
            samples: samples in this step's batch; rounds weight peers by samples processed,
                so faster peers count more. Default: 1 per step.
            loss: this step's training loss (a float or a scalar tensor; a CUDA tensor costs a
                sync, so pass ``loss.item()`` where you have it anyway). Optional; with it, a
                sharp rise is logged as a WARNING and flagged in the report (``diverging``);
                it is also published with the peer's progress (``swarm-peer status``).

        Returns:
            A :class:`StepReport` (``round_due``/``averaged``/``reason`` tell what happened).
        """
        report = await self._step(samples, loss, self._awaiting)
        if (read := self._read_ahead()) is not None:
            read()
        await asyncio.sleep(0)  # one turn of the loop per step: a round in flight moves on
        return report

    async def _step(self, samples: float | None, loss: Any, rounds: Rounds) -> StepReport:
        """One step, its rounds run by ``rounds`` (``Swarm`` drives this in its own thread)."""
        self.peer.progress.note_loss(loss)
        return await drive(self.engine.step(samples, loss), rounds)

    def _read_ahead(self) -> Callable[[], None] | None:
        """The read of the peer list to start now, when a round falls due within seconds."""
        soon = self._lookout.due_soon(self.engine.seconds_to_due())
        return self.averager.read_ahead if soon and self.averager is not None else None

    async def wait_round(self) -> StepReport | None:
        """Wait for the round in flight (overlap) and apply it; None when none runs.

        Call before evaluating the swarm's model at the end of training; :meth:`save`,
        :meth:`load` and :meth:`average_parameters` call it themselves.
        """
        return await self._wait_round(self._awaiting)

    async def _wait_round(self, rounds: Rounds) -> StepReport | None:
        return await drive(self.engine.wait_round(), rounds)

    async def average_parameters(self) -> RoundOutcome:
        """Average the parameters and buffers themselves once (e.g. at the end of training).

        After a successful round with codec ``none`` every member holds the same model. Under
        top-K, 1-bit or ``sparse`` it averages the parameters in ``anchor_sync_codec``; in
        ``diloco`` each model's difference from its anchor instead, in 1-bit, and the
        anchors in ``anchor_sync_codec`` only where members' anchors differ (about 1/7 of an
        ``int8`` round of the values where they agree); then, in a second round, the floating
        buffers (BatchNorm statistics), which their training rounds leave local. A group
        whose members hold the same values already (a swarm that trained as one group in a
        dense codec) sends nothing: they compare digests while the group forms.
        See :mod:`swarm.training.final_average`.
        Its groups cross regions along a grid: ``ceil(log(peers) / log(target_group_size))``
        calls in a row bring the swarm to one model (:mod:`swarm.averaging.groups.converge`).
        """
        await self.wait_round()  # the slots are the round in flight's until it lands
        return await drive(average_values(self.engine), self._awaiting)

    async def shard(self, num_items: int, num_shards: int | None = None) -> list[int]:
        """Indices of the items this peer should train on; disjoint across live peers.

        See :mod:`swarm.training.sharding` (rendezvous hashing over the live peer list).
        Call again each epoch: peers joining or leaving move only their own shards.
        """
        peers = await self.peer.known_peers()
        ids = [pid.digest for pid in peers]
        me = self.peer.peer_id.digest
        return my_items(ids, me, num_items, num_shards, salt=self.config.peer.run_id)

    async def known_peers(self) -> dict[PeerID, PeerRecord]:
        """Live peers of this run (PeerID -> PeerRecord), this one included."""
        return await self.peer.known_peers()

    async def save(self, path: str | Path) -> None:
        """Checkpoint model, optimizer, outer state, error-feedback residuals and round.

        A round in flight is waited for and applied first: the checkpoint holds the state the
        peers agree on after it.
        """
        await self.wait_round()
        averager_state = self.averager.state_dict() if self.averager is not None else {}
        state = await asyncio.to_thread(self.engine.state_dict, averager_state)
        await asyncio.to_thread(write_checkpoint, path, state)

    async def load(self, path: str | Path) -> None:
        """Resume from a checkpoint. Raises CheckpointError if corrupt or of another model."""
        state = await asyncio.to_thread(read_checkpoint, path)
        await self.wait_round()
        averager_state = await asyncio.to_thread(self.engine.load_state_dict, state)
        if averager_state and self.averager is not None:
            self.averager.load_state_dict(averager_state)

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def address(self) -> str:
        """``HOST:PORT`` other peers pass as ``initial_peers``."""
        return str(self.peer.address)

    async def close(self) -> None:
        """Leave the swarm (cancels a round in flight, closes the averager, then the peer)."""
        rounds, self._rounds = list(self._rounds), set()
        for task in rounds:
            task.cancel()
        await asyncio.gather(*rounds, return_exceptions=True)
        averager, self.averager, peer, self.peer = self.averager, None, self.peer, None
        if averager is not None:
            await averager.close()
        if peer is not None:
            await peer.close()


class Swarm:
    """Train ``model`` with the swarm; replaces ``optimizer.step()`` with ``swarm.step()``.

    Args:
        model: a torch module on one device (CPU or CUDA; fp32, fp16 or bf16).
        optimizer: the local (inner) optimizer, e.g. AdamW; the swarm calls its ``step()``.
        config: a full :class:`~swarm.config.SwarmConfig` instead of keyword options.
        **options: any field of the config tree, by name: :class:`~swarm.config.SwarmConfig`
            (``mode``, ``inner_steps``, ``outer_lr``, ...), :class:`~swarm.config.PeerConfig`
            (``run_id``, ``initial_peers``, ``listen``, ``identity_path``, ``port_mapping``,
            ``relay_peers``, ``reachability``, ...) and :class:`~swarm.config.AveragingConfig`
            (``codec``, ``min_group_size``, ``round_timeout_s``, ``aggregator``, ...). A field
            not given here is read from its environment variable when set, the one
            ``swarm-peer`` reads for a peer's fields (``SWARM_INITIAL_PEERS=1.2.3.4:31415``,
            ``SWARM_HEARTBEAT``, ``SWARM_KEY_FILE``; see :mod:`swarm.peer_flags`) and
            ``SWARM_<FIELD>`` for the others (``SWARM_INNER_STEPS=50``), else it keeps its
            default. ``run_id``
            names the training run (peers of other runs are ignored); ``initial_peers`` are
            ``HOST:PORT`` of live peers, empty to start a new swarm (a peer that joins a running
            swarm downloads the current state before its first step).

    Raises:
        ConfigError: invalid or unknown options (the message names the closest valid one).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="swarm-loop", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self._async = self._run(self._create(model, optimizer, kwargs))
        except BaseException:
            self._stop_loop()
            raise
        self.config = self._async.config
        self.engine = self._async.engine
        self._blocking = BlockingRounds(self._round, self._start_round)

    async def _create(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]
    ) -> AsyncSwarm:
        return await AsyncSwarm.create(model, optimizer, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float | None = None) -> T:
        if self._closed:
            raise TrainingError("the swarm is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def step(self, samples: float | None = None, loss: Any = None) -> StepReport:
        """Use instead of ``optimizer.step()``; does not zero gradients.

        Every ``inner_steps`` steps an averaging round starts. With ``overlap`` (the
        default in ``diloco``) it runs in the background on the swarm's loop thread
        and lands at a later step; a step blocks only when the next round is due before the
        last one finished (the report's ``wait_s``). Otherwise the step blocks for the round
        (at most ``round_timeout_s``). A failed round is reported (``averaged=False``,
        ``reason``) and logged once at WARNING; training goes on.

        Args:
            samples: samples in this step's batch (weights rounds); default 1 per step.
            loss: this step's training loss (float or scalar tensor), optional: a sharp rise
                is logged as a WARNING and flagged in the report (``diverging``).
        """
        # AsyncSwarm's step, driven in this thread: a round runs on the loop thread
        report = run_inline(self._async._step(samples, loss, self._blocking))
        if (read := self._async._read_ahead()) is not None:
            self._loop.call_soon_threadsafe(read)
        return report

    def wait_round(self) -> StepReport | None:
        """Wait for the round in flight and apply it; see :meth:`AsyncSwarm.wait_round`."""
        return run_inline(self._async._wait_round(self._blocking))

    def _round(self, plan: RoundPlan) -> RoundOutcome:
        try:
            return self._run(
                self._async.average_round(plan), self.config.averaging.round_timeout_s + 10
            )
        except concurrent.futures.TimeoutError:
            return RoundOutcome.failed("round timed out")

    def _start_round(self, plan: RoundPlan) -> RoundHandle:
        if self._closed:
            raise TrainingError("the swarm is closed")
        return asyncio.run_coroutine_threadsafe(self._async.average_round(plan), self._loop)

    def average_parameters(self) -> RoundOutcome:
        """Average the parameters and buffers themselves once (e.g. at the end of training)."""
        # up to two rounds: the values, then the buffers a sparse codec leaves local
        return self._run(
            self._async.average_parameters(), 2 * self.config.averaging.round_timeout_s + 10
        )

    def shard(self, num_items: int, num_shards: int | None = None) -> list[int]:
        """Indices of the items this peer trains on; see :meth:`AsyncSwarm.shard`."""
        return self._run(self._async.shard(num_items, num_shards), 60)

    def known_peers(self) -> dict[PeerID, PeerRecord]:
        """Live peers of this run (PeerID -> PeerRecord), this one included."""
        return self._run(self._async.known_peers(), 60)

    def save(self, path: str | Path) -> None:
        """Checkpoint model, optimizer, outer state, error-feedback residuals and round.

        A round in flight is waited for and applied first (see :meth:`AsyncSwarm.save`).
        """
        self._run(self._async.save(path))

    def load(self, path: str | Path) -> None:
        """Resume from a checkpoint. Raises CheckpointError if corrupt or of another model."""
        self._run(self._async.load(path))

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def peer(self) -> Peer | None:
        return self._async.peer

    @property
    def address(self) -> str:
        """``HOST:PORT`` other peers pass as ``initial_peers``."""
        return self._async.address

    def close(self) -> None:
        """Leave the swarm and stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._run(self._async.close(), 60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        loop = self._loop

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(30)
        loop.close()


def _since(plan: RoundPlan) -> float:
    return time.perf_counter() - plan.started if plan.started else 0.0
