"""Group averaging: two jobs, one subpackage each, and the averager that runs them.

- :mod:`swarm.averaging.groups`: forming groups (coordinates, probes, regions, the planner,
  matchmaking through the DHT, liveness, measured rates)
- :mod:`swarm.averaging.butterfly`: the all-reduce inside a group (parts, senders, owners,
  robust reduction, owner checks, stalls, repair)
- :mod:`swarm.averaging.averager`: :class:`Averager`, the public entry point: a group, then a
  butterfly, then the report
- :mod:`swarm.averaging.result`: what a round reports (:class:`RoundResult`, refusals)
- :mod:`swarm.averaging.faults`: misbehaviour injected by tests through the real code
"""

from swarm.averaging.averager import Averager
from swarm.averaging.butterfly.parts import PartPlan, chunk_elems_for, schema_hash, split_parts
from swarm.averaging.faults import Fault
from swarm.averaging.groups.group import Declaration, GroupInfo, choose_leader, matchmaking_key
from swarm.averaging.result import RoundResult
from swarm.config import AveragingConfig

__all__ = [
    "Averager",
    "AveragingConfig",
    "Declaration",
    "Fault",
    "GroupInfo",
    "PartPlan",
    "RoundResult",
    "choose_leader",
    "chunk_elems_for",
    "matchmaking_key",
    "schema_hash",
    "split_parts",
]
