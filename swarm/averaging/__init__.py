"""Group averaging: DHT matchmaking and butterfly all-reduce.

- :mod:`swarm.averaging.plan`: who owns which slice of the flat vector (sans-I/O)
- :mod:`swarm.averaging.group`: declarations, the leader rule, the agreed group (sans-I/O)
- :mod:`swarm.averaging.reducer`: weighted reduction of one part (sans-I/O)
- :mod:`swarm.averaging.feedback`: error feedback over slices of the flat vector
- :mod:`swarm.averaging.coordinates`: Vivaldi network coordinates (sans-I/O)
- :mod:`swarm.averaging.regions`: regions, near and cross rounds: group keys (sans-I/O)
- :mod:`swarm.averaging.prober`: RTT probes that keep this peer's coordinate published
- :mod:`swarm.averaging.matchmaking`: forming a group through the DHT and the join RPC
- :mod:`swarm.averaging.allreduce`: the streams of one all-reduce
- :mod:`swarm.averaging.averager`: :class:`Averager`, the public entry point
- :mod:`swarm.averaging.sync`: :class:`SyncAverager`, its blocking twin
"""

from swarm.averaging.averager import Averager
from swarm.averaging.group import Declaration, GroupInfo, choose_leader, matchmaking_key
from swarm.averaging.plan import PartPlan, chunk_elems_for, schema_hash, split_parts
from swarm.averaging.result import Fault, RoundResult
from swarm.averaging.sync import SyncAverager

__all__ = [
    "Averager",
    "Declaration",
    "Fault",
    "GroupInfo",
    "PartPlan",
    "RoundResult",
    "SyncAverager",
    "choose_leader",
    "chunk_elems_for",
    "matchmaking_key",
    "schema_hash",
    "split_parts",
]
