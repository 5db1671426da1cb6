"""Who holds how much of a full store, by subnet, host and owner, and whom to evict (sans-I/O).

When a key (or the whole node) is full, a newcomer gets room by evicting from whoever holds the
most, compared level by level so that free identities and ports buy nothing:

1. the subnet holding the most, if it holds more than the newcomer's subnet would after the
   store; otherwise, inside the newcomer's own subnet,
2. the host holding the most there, if it holds more than the newcomer's host would; otherwise,
   inside the newcomer's own host,
3. the owner holding the most there, if it holds more than the newcomer would;
4. otherwise nobody: every group already holds its fair share, and the newcomer is refused.

Inside the group chosen, the victim is the biggest host's biggest owner's newest member (among
equals, the newest host and owner), so the older slots of a crowded group (those with the
longest witnessed age) are the last to go.

Cost to honest peers: those that share a subnet or host with a crowd share its fate: when the
store is full, they lose slots before peers of other subnets do. A newcomer from a subnet that
holds less than the biggest one always gets room.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

from swarm.dht.provenance import Origin

_Leaf = tuple[str, str, bytes]  # (subnet, host, owner)
K = TypeVar("K")


class ScopeTally:
    """Amounts (slots or bytes) per subnet, host and owner, and the members that make them up."""

    def __init__(self) -> None:
        self._subnets: dict[str, int] = {}
        self._hosts: dict[tuple[str, str], int] = {}
        self._owners: dict[_Leaf, int] = {}
        self._hosts_of: dict[str, dict[str, None]] = {}
        self._owners_of: dict[tuple[str, str], dict[bytes, None]] = {}
        self._members: dict[_Leaf, dict[Hashable, int]] = {}  # in insertion order: oldest first

    def add(self, origin: Origin, owner: bytes, member: Hashable, amount: int) -> None:
        leaf = (origin.subnet, origin.host, owner)
        self._members.setdefault(leaf, {})[member] = amount
        self._subnets[leaf[0]] = self._subnets.get(leaf[0], 0) + amount
        self._hosts[leaf[:2]] = self._hosts.get(leaf[:2], 0) + amount
        self._owners[leaf] = self._owners.get(leaf, 0) + amount
        self._hosts_of.setdefault(leaf[0], {})[leaf[1]] = None
        self._owners_of.setdefault(leaf[:2], {})[owner] = None

    def remove(self, origin: Origin, owner: bytes, member: Hashable) -> None:
        leaf = (origin.subnet, origin.host, owner)
        members = self._members[leaf]
        amount = members.pop(member)
        self._owners[leaf] -= amount
        self._hosts[leaf[:2]] -= amount
        self._subnets[leaf[0]] -= amount
        if members:
            return
        del self._members[leaf], self._owners[leaf]
        owners = self._owners_of[leaf[:2]]
        del owners[owner]
        if owners:
            return
        del self._owners_of[leaf[:2]], self._hosts[leaf[:2]]
        hosts = self._hosts_of[leaf[0]]
        del hosts[leaf[1]]
        if not hosts:
            del self._hosts_of[leaf[0]], self._subnets[leaf[0]]

    def amount(self, origin: Origin, owner: bytes | None = None) -> int:
        """What ``origin``'s subnet holds, or its host's ``owner`` when one is given."""
        if owner is None:
            return self._subnets.get(origin.subnet, 0)
        return self._owners.get((origin.subnet, origin.host, owner), 0)

    def victim(self, origin: Origin, owner: bytes, amount: int) -> Hashable | None:
        """The member to evict so that ``amount`` more of ``owner`` from ``origin`` fits
        fairly (see the module docstring), or None when nobody holds more than its share."""
        subnet, host = origin.subnet, origin.host
        other = _biggest(self._subnets, (s for s in self._subnets if s != subnet))
        if other is not None and self._subnets[other] > self._subnets.get(subnet, 0) + amount:
            return self._newest_in(other)
        hosts = [(subnet, h) for h in self._hosts_of.get(subnet, {}) if h != host]
        other_host = _biggest(self._hosts, hosts)
        if other_host is not None and (
            self._hosts[other_host] > self._hosts.get((subnet, host), 0) + amount
        ):
            return self._newest_in(subnet, other_host[1])
        owners = [(subnet, host, o) for o in self._owners_of.get((subnet, host), {}) if o != owner]
        other_owner = _biggest(self._owners, owners)
        if other_owner is not None and (
            self._owners[other_owner] > self._owners.get((subnet, host, owner), 0) + amount
        ):
            return next(reversed(self._members[other_owner]))
        return None

    def _newest_in(self, subnet: str, host: str | None = None) -> Hashable:
        """The newest member of the biggest owner of ``host`` (default: the subnet's biggest)."""
        if host is None:
            host = _biggest(self._hosts, [(subnet, h) for h in self._hosts_of[subnet]])[1]  # type: ignore[index]
        leaf = _biggest(self._owners, [(subnet, host, o) for o in self._owners_of[(subnet, host)]])
        return next(reversed(self._members[leaf]))  # type: ignore[index]


def _biggest(amounts: Mapping[K, int], keys: Iterable[K]) -> K | None:
    """The key with the largest amount; among equals, the one seen last (the newest)."""
    return max(reversed(list(keys)), key=amounts.__getitem__, default=None)
