"""The DHT: kademlia extended with authenticated datagrams and signed, merged dictionary records.

- :mod:`swarm.dht.records`: owner-signed entries and the merging storage (sans-I/O)
- :mod:`swarm.dht.provenance`: each stored slot's origin (host, subnet) and witnessed age
- :mod:`swarm.dht.scopes`: whom a full key or node evicts, by subnet, host, then owner
- :mod:`swarm.dht.listing`: the order of a key's owners in answers (round-robin over subnets)
- :mod:`swarm.dht.pages`: one ``find_value`` answer page, with the entries' ages
- :mod:`swarm.dht.reads`: merging several holders' answers (newest verified entry, median age)
- :mod:`swarm.dht.envelope`: sealing and opening authenticated datagrams (sans-I/O)
- :mod:`swarm.dht.limits`: budgets per host and subnet, return-routability cookies (sans-I/O)
- :mod:`swarm.dht.intake`: what a store request may add (budgets, signatures, forgery penalty)
- :mod:`swarm.dht.routing`: contacts with keys, the routing table with a complete neighbour search
- :mod:`swarm.dht.protocol`: kademlia's protocol class with validated RPCs and fixed replication
- :mod:`swarm.dht.lookup`: the iterative lookup that ends at the k closest nodes
- :mod:`swarm.dht.node`: :class:`DHTNode`, what the rest of swarm uses
"""

from swarm.dht.node import DHTNode
from swarm.dht.records import DHTEntry, key_digest

__all__ = ["DHTEntry", "DHTNode", "key_digest"]
