"""Forming groups: who averages with whom in a round, agreed through the DHT.

- :mod:`~swarm.averaging.groups.coordinates`: Vivaldi network coordinates (sans-I/O)
- :mod:`~swarm.averaging.groups.prober`: RTT probes that keep this peer's coordinate published
- :mod:`~swarm.averaging.groups.regions`: regions, near and cross rounds: group keys (sans-I/O)
- :mod:`~swarm.averaging.groups.planner`: the group key of each round from the prober's view,
  the round order the groups agree on, peers known to be gone
- :mod:`~swarm.averaging.groups.group`: declarations, the leader rule, the agreed group (sans-I/O)
- :mod:`~swarm.averaging.groups.matchmaking`: forming a group through the DHT and the join RPC
- :mod:`~swarm.averaging.groups.match_round`: one matchmaking round's state
- :mod:`~swarm.averaging.groups.declarations`: declarations stored in and read from the DHT
- :mod:`~swarm.averaging.groups.join_desk`: a leader's join RPC and its patience
- :mod:`~swarm.averaging.groups.liveness`: one ping tells a killed peer from a slow one
- :mod:`~swarm.averaging.groups.rates`: upload rates of other peers as this peer measured them
- :mod:`~swarm.averaging.groups.loop_lag`: this peer's event-loop hold-ups while probes run
- :mod:`~swarm.averaging.groups.apart`: peers that refuse each other, kept out of one group
- :mod:`~swarm.averaging.groups.peer_tags`: the short tags that name peers in a record
"""
