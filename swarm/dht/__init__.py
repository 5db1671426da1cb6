"""The DHT: kademlia extended with authenticated datagrams and signed, merged dictionary records.

Records (sans-I/O):

- :mod:`swarm.dht.records`: owner-signed entries and the merging storage
- :mod:`swarm.dht.provenance`: each stored slot's origin (host, subnet) and witnessed age
- :mod:`swarm.dht.scopes`: whom a full key or node evicts, by subnet, host, then owner
- :mod:`swarm.dht.listing`: the order of a key's owners in answers (round-robin over subnets)
- :mod:`swarm.dht.pages`: one ``find_value`` answer page, with the entries' ages
- :mod:`swarm.dht.reads`: merging several holders' answers (newest verified entry, median age)

Datagrams and what they may cost (sans-I/O):

- :mod:`swarm.dht.envelope`: sealing and opening authenticated datagrams
- :mod:`swarm.dht.request_format`: a request's body (shape, arity) and the padding of one
  without a cookie
- :mod:`swarm.dht.budgets`: work budgets per host and subnet (datagrams, public-key work, slots)
- :mod:`swarm.dht.cookies`: return-routability cookies (an answer no larger than an unproved
  request)
- :mod:`swarm.dht.store_intake`: what a store request may add (budgets, signatures, forgery
  penalty)
- :mod:`swarm.dht.routing`: contacts with keys, the routing table with a complete neighbour search
- :mod:`swarm.dht.rtt`: how long to wait for an answer, and when a request stalls a lookup
- :mod:`swarm.dht.suspects`: contacts that failed to answer (skipped, evicted, remembered)

The protocol and its parts:

- :mod:`swarm.dht.protocol`: kademlia's protocol class: datagrams in, routing-table upkeep,
  tracked tasks; composes the parts below
- :mod:`swarm.dht.answers`: the RPC handlers, and the room an answer may take
- :mod:`swarm.dht.calls`: our requests and their answers (cookies echoed, failures counted)
- :mod:`swarm.dht.replication`: newcomers' records, batched and sent at a bounded rate
- :mod:`swarm.dht.lookup`: the iterative lookup that ends at the k closest nodes
- :mod:`swarm.dht.node`: :class:`DHTNode`, what the rest of swarm uses
"""

from swarm.dht.node import DHTNode
from swarm.dht.records import DHTEntry, key_digest

__all__ = ["DHTEntry", "DHTNode", "key_digest"]
