"""A multi-GPU node as one swarm peer: ``torchrun --nproc-per-node K train.py``.

Inside the node the K processes train as with DDP: every step their gradients are averaged with
``torch.distributed`` (NCCL on GPUs, gloo on CPUs), so each process applies the same update and
keeps the same weights. Only rank 0 is a swarm peer: it joins the swarm, takes part in the rounds,
and after each round broadcasts the averaged model (parameters and floating buffers) to the other
ranks. The swarm sees one peer per node, weighted by the samples of all its processes::

    torch.distributed.init_process_group("nccl")
    with NodeSwarm(model, optimizer, run_id="my-run", initial_peers=[...]) as swarm:
        for x, y in loader:                      # each rank its own shard
            loss_fn(model(x), y).backward()
            swarm.step(samples=len(x))           # instead of optimizer.step()
            optimizer.zero_grad()

Every rank must call every method (they are collective), like DDP's forward/backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from swarm.api import Swarm
from swarm.errors import ConfigError
from swarm.training.report import StepReport


def changes_model(report: StepReport | None) -> bool:
    """Whether the swarm moved rank 0's model at this step: a round ended (landed), or one
    started in the background and its eager outer step moved the model."""
    return report is not None and (report.round_due or report.round_started)


class NodeSwarm:
    """One swarm peer for a whole ``torch.distributed`` group; rank 0 talks to the swarm.

    Args:
        model: this rank's replica (same architecture and initial weights on every rank is not
            needed: rank 0's weights are broadcast at the start).
        optimizer: this rank's inner optimizer; every rank steps it with the same averaged
            gradients, so the inner optimizer state stays identical across ranks.
        group: the process group of this node (default: the whole default group).
        **options: for rank 0's :class:`~swarm.api.Swarm` (``run_id``, ``initial_peers``,
            ``listen``, ...); other ranks ignore them.

    Raises:
        ConfigError: torch.distributed is not initialized.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
        **options: Any,
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("NodeSwarm needs torch.distributed.init_process_group() first")
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._params = [p for p in model.parameters()]
        self._state = self._params + [b for b in model.buffers() if b.is_floating_point()]
        self._device = self._params[0].device
        self.swarm: Swarm | None = None
        mode = torch.zeros(1, dtype=torch.int32, device=self._device)
        if self.rank == 0:  # joins (and, as a late joiner, downloads the swarm's state)
            self.swarm = Swarm(model, optimizer, **options)
            mode.fill_(int(self.swarm.config.mode == "gradients"))
        dist.broadcast(mode, src=self._src, group=self.group)
        # In gradients mode rank 0 steps with the swarm's averaged gradients: the others take
        # those too, so that every rank's inner optimizer state stays the same.
        self._follow_gradients = bool(mode.item())
        self._broadcast_state()
        self.last_report: StepReport | None = None

    @property
    def is_peer(self) -> bool:
        """Whether this rank is the node's swarm peer."""
        return self.swarm is not None

    @property
    def address(self) -> str | None:
        """Rank 0's ``HOST:PORT`` for others' ``initial_peers``; None on the other ranks."""
        return self.swarm.address if self.swarm is not None else None

    def step(self, samples: float | None = None) -> StepReport | None:
        """Average gradients in the node, step, and follow rank 0 after a swarm round.

        Args:
            samples: samples in this rank's batch (rank 0 reports the node's total).

        Returns:
            Rank 0's :class:`~swarm.training.report.StepReport`; None on other ranks.
        """
        self._average_gradients()
        local = 1.0 if samples is None else float(samples)
        total = torch.tensor([local], dtype=torch.float64, device=self._device)
        dist.all_reduce(total, group=self.group)
        flag = torch.zeros(1, dtype=torch.int32, device=self._device)
        report = None
        if self.swarm is not None:
            report = self.swarm.step(samples=float(total.item()))
            flag.fill_(int(changes_model(report)))
        if self._follow_gradients:
            self._broadcast([p.grad for p in self._params])
        if self.swarm is None:
            self.optimizer.step()
        self._follow(flag)
        self.last_report = report
        return report

    def wait_round(self) -> StepReport | None:
        """Land rank 0's round in flight (before evaluating or saving), and give every rank the
        model it lands on. Collective, like :meth:`step`.

        Returns:
            Rank 0's report of the landed round (None on other ranks, or with none in flight).
        """
        flag = torch.zeros(1, dtype=torch.int32, device=self._device)
        report = None
        if self.swarm is not None:
            report = self.swarm.wait_round()
            flag.fill_(int(changes_model(report)))
        self._follow(flag)
        return report

    def _follow(self, flag: torch.Tensor) -> None:
        """One small broadcast tells the other ranks whether the swarm changed rank 0's model;
        then rank 0's state follows, so every rank holds bit-identical weights after each call."""
        dist.broadcast(flag, src=self._src, group=self.group)
        if int(flag.item()):
            self._broadcast_state()

    def close(self) -> None:
        """Leave the swarm (rank 0), then wait for every rank; the process group stays open.

        A round still in flight is cancelled, not landed: every rank keeps the model of the
        last step (call :meth:`wait_round` first to land it)."""
        if self.swarm is not None:
            self.swarm.close()
        dist.barrier(group=self.group)

    def __enter__(self) -> NodeSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """Mean of every parameter's gradient over the node's ranks (missing ones count as 0)."""
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def _broadcast_state(self) -> None:
        """Rank 0's parameters and floating buffers to every rank of the node."""
        self._broadcast(self._state)

    @torch.no_grad()
    def _broadcast(self, tensors: list[Any]) -> None:
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])  # one collective
        dist.broadcast(flat, src=self._src, group=self.group)
        if self.rank != 0:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
