"""Training with the swarm: DiLoCo / local SGD / gradient averaging, joiners, checkpoints.

The step and its rounds:

- :mod:`~swarm.training.engine`: :class:`TrainingEngine`, the step/round state machine
- :mod:`~swarm.training.rounds`: round plans and outcomes (what a step and the network exchange)
- :mod:`~swarm.training.driver`: the one loop that answers a step, blocking or awaited
- :mod:`~swarm.training.outer_rule`: the DiLoCo outer step and its rule for changing groups
- :mod:`~swarm.training.outer`: the fp32 state it moves (anchors, slots, momentum)
- :mod:`~swarm.training.overlap`: overlapped rounds that land a few steps late
- :mod:`~swarm.training.fragments`: Streaming DiLoCo's fragments of the model
- :mod:`~swarm.training.final_average`: rounds that average the values (``average_parameters``)
- :mod:`~swarm.training.tensors`: which tensors are averaged, and the schema hash
- :mod:`~swarm.training.divergence`: a sharp rise of the loss, round by round
- :mod:`~swarm.training.report`: :class:`StepReport`, what ``step()`` returns

State kept and shared:

- :mod:`~swarm.training.persistence`: snapshots for joiners and checkpoints of an engine
- :mod:`~swarm.training.snapshot`: the byte format of a snapshot
- :mod:`~swarm.training.checkpoint`: atomic, checksummed checkpoint files
- :mod:`~swarm.training.transfer`: serving a snapshot and downloading one in parts
- :mod:`~swarm.training.agreement`: which state a joiner adopts (weighted agreement, no I/O)
- :mod:`~swarm.training.joining`: the joiner's side: ask, decide, download, or train its own
- :mod:`~swarm.training.sharding`: disjoint data shards without a coordinator

The user-facing classes live in :mod:`swarm.api`.
"""

from swarm.training.outer_rule import outer_step
from swarm.training.report import StepReport

__all__ = ["StepReport", "outer_step"]
