"""Training with the swarm: DiLoCo / local SGD / gradient averaging, joiners, checkpoints.

Modules: ``outer`` (the DiLoCo outer step and its fp32 state), ``tensors`` (what is averaged,
schema hash), ``engine`` (the step/round state machine shared by both facades), ``transfer``
(state download for late joiners), ``snapshot`` (its byte format), ``checkpoint`` (atomic,
checksummed files), ``sharding`` (disjoint data shards without a coordinator), ``progress``
(:class:`StepReport`). The user-facing classes live in :mod:`swarm.api`.
"""

from swarm.training.outer import outer_step
from swarm.training.report import StepReport

__all__ = ["StepReport", "outer_step"]
