"""Contacts and the routing table: kademlia's k-buckets, with the keys a contact needs.

A contact's node id is derived from its keys (SHA-1 of its Ed25519 and X25519 public keys), so a
node cannot pick where it sits in the key space, and two processes sharing one identity file
still get distinct ids. Contacts travel in ``find_node`` answers with their keys, so the first
request to a new contact is already MAC'd for it.

Fixes over kademlia 2.2.3's :class:`~kademlia.routing.RoutingTable`:

- ``find_neighbors`` walked buckets outward from the key's bucket but stopped after two buckets
  when the key fell in the last one (fewer than k contacts, sometimes none); :meth:`closest`
  ranks every contact.
- a full bucket pinged its head with a fire-and-forget task; here the protocol tracks it.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import ipaddress
from collections.abc import Collection
from typing import Any

from kademlia.node import Node
from kademlia.routing import RoutingTable

from swarm.dht.envelope import SenderKeys
from swarm.errors import DHTError
from swarm.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES

_NODE_ID_CONTEXT = b"swarm/dht-node-id/v1"
MAX_HOST_CHARS = 64


def node_id_of(keys: SenderKeys) -> bytes:
    """The 160-bit node id that belongs to these keys."""
    return hashlib.sha1(_NODE_ID_CONTEXT + keys.public_key + keys.agreement_key).digest()


class Contact(Node):
    """A DHT node we can reach: kademlia's Node plus the keys that authenticate it."""

    def __init__(self, keys: SenderKeys, ip: str, port: int):
        super().__init__(node_id_of(keys), ip, port)
        self.keys = keys
        self.client = False  # flagged its requests as a client's: never routed to

    @property
    def address(self) -> tuple[str, int]:
        return (self.ip, self.port)

    def to_wire(self) -> list[Any]:
        k = self.keys
        return [k.public_key, k.agreement_key, k.agreement_signature, self.ip, self.port]

    @classmethod
    def from_wire(cls, obj: Any) -> Contact:
        """Parse a contact from a ``find_node`` answer (its binding is checked when used).

        Raises:
            DHTError: wrong shape, types, sizes, or a host that is not an IP address.
        """
        if not isinstance(obj, list) or len(obj) != 5:
            raise DHTError("a contact is [public_key, agreement_key, signature, ip, port]")
        public, agreement, signature, ip, port = obj
        if not isinstance(public, bytes) or len(public) != PUBLIC_KEY_BYTES:
            raise DHTError("contact public key must be 32 bytes")
        if not isinstance(agreement, bytes) or len(agreement) != 32:
            raise DHTError("contact agreement key must be 32 bytes")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise DHTError("contact signature must be 64 bytes")
        if not isinstance(ip, str) or len(ip) > MAX_HOST_CHARS:
            raise DHTError("contact host must be an IP address")
        if not _is_ip(ip):
            raise DHTError(f"contact host {ip!r} is not an IP address")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise DHTError("contact port must be 1..65535")
        return cls(SenderKeys(public, agreement, signature), ip, port)


@functools.lru_cache(maxsize=4096)
def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class SwarmRoutingTable(RoutingTable):
    """kademlia's k-buckets with a complete :meth:`closest` and tracked head pings."""

    def closest(self, target: bytes, k: int | None = None, exclude: Collection[bytes] = ()) -> list:
        """The ``k`` contacts closest to ``target`` (a 20-byte id) by XOR distance, leaving out
        the ids in ``exclude``."""
        k = k or self.ksize
        goal = int.from_bytes(target, "big")
        contacts = (c for b in self.buckets for c in b.nodes.values() if c.id not in exclude)
        return heapq.nsmallest(k, contacts, key=lambda c: c.long_id ^ goal)

    def find_neighbors(self, node: Node, k: int | None = None, exclude: Node | None = None) -> list:
        found = self.closest(node.id, (k or self.ksize) + 1)
        found = [c for c in found if c.id != node.id]
        if exclude is not None:
            found = [c for c in found if not c.same_home_as(exclude)]
        return found[: k or self.ksize]

    def contacts(self) -> list:
        return [c for b in self.buckets for c in b.nodes.values()]

    def empty(self) -> bool:
        return not any(b.nodes for b in self.buckets)

    def add_contact(self, node: Node) -> None:
        index = self.get_bucket_for(node)
        bucket = self.buckets[index]
        current = bucket[node.id]
        if current is not None and current.address != node.address:
            bucket.remove_node(current)  # the node moved: keep its new address
        if bucket.add_node(node):
            return
        # kademlia section 4.2: split when the bucket holds our own id, or its depth allows
        if bucket.has_in_range(self.node) or bucket.depth() % 5 != 0:
            self.split_bucket(index)
            self.add_contact(node)
        else:
            self.protocol.check_alive(bucket.head())
