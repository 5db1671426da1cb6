"""Group averaging: DHT matchmaking and butterfly all-reduce.

- :mod:`swarm.averaging.plan`: who owns which slice of the flat vector (sans-I/O)
- :mod:`swarm.averaging.group`: declarations, the leader rule, the agreed group (sans-I/O)
- :mod:`swarm.averaging.reducer`: weighted reduction of one part (sans-I/O)
- :mod:`swarm.averaging.feedback`: error feedback over slices of the flat vector
- :mod:`swarm.averaging.coordinates`: Vivaldi network coordinates (sans-I/O)
- :mod:`swarm.averaging.regions`: regions, near and cross rounds: group keys (sans-I/O)
- :mod:`swarm.averaging.prober`: RTT probes that keep this peer's coordinate published
- :mod:`swarm.averaging.planner`: the group key of each round from the prober's view, the
  round order the groups agree on, peers known to be gone
- :mod:`swarm.averaging.matchmaking`: forming a group through the DHT and the join RPC
- :mod:`swarm.averaging.stall`: when to give up on a silent peer (sans-I/O)
- :mod:`swarm.averaging.owner`: the owner's side of one part (reduce, stream the average back)
- :mod:`swarm.averaging.sender`: the sender's side of one part (stream a share, stage the average)
- :mod:`swarm.averaging.allreduce`: one member's butterfly all-reduce over owner and senders
- :mod:`swarm.averaging.flat`: the round's tensors as one flat vector, and back (staging)
- :mod:`swarm.averaging.registry`: which round an inbound part stream belongs to (bounded)
- :mod:`swarm.averaging.faults`: misbehaviour injected by tests through the real code
- :mod:`swarm.averaging.averager`: :class:`Averager`, the public entry point
"""

from swarm.averaging.averager import Averager
from swarm.averaging.faults import Fault
from swarm.averaging.group import Declaration, GroupInfo, choose_leader, matchmaking_key
from swarm.averaging.plan import PartPlan, chunk_elems_for, schema_hash, split_parts
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
