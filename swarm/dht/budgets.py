"""Work budgets of the DHT (sans-I/O): how much one host and one subnet may make a node do.

- :class:`HostBuckets` (from :mod:`swarm.hosts`, re-exported) meters work per host (IPv4 /32,
  IPv6 /64) and per subnet (/24, /48) together, never per ``(address, port)``: 64 sockets of one
  host share one budget, 16 addresses of one /24 share :data:`SUBNET_SHARE` hosts' worth. The
  budgets below are sized so that a few honest peers behind one address (a NAT), or a test with
  dozens of peers on one loopback address, never meet them, while a flood from a host costs the
  node at most a few percent of a core (an Ed25519 check is ~0.1-0.2 ms):

  ===============  ==============================  ===========  ========
  budget           meters                          host rate/s  burst
  ===============  ==============================  ===========  ========
  datagrams        every datagram, before parsing  1000         4000
  public-key work  signature checks, agreements    200          800
  new slots        slots a store adds              50           400
  ===============  ==============================  ===========  ========

  A forged entry costs its sender :data:`FORGERY_PENALTY` of public-key work on top (see
  :mod:`swarm.dht.store_intake`).
- :class:`TokenBuckets` (from :mod:`swarm.hosts`, re-exported) meters anything per key.

Return-routability cookies, the other bound on what a source gets out of a node, are in
:mod:`swarm.dht.cookies`.
"""

from __future__ import annotations

from swarm.hosts import HostBuckets, TokenBuckets

__all__ = ["HostBuckets", "TokenBuckets"]

SUBNET_SHARE = 4.0  # a subnet's budgets, in hosts' budgets
DATAGRAM_RATE = 1000.0  # datagrams per second from one host, sustained
DATAGRAM_BURST = 4000.0
VERIFY_RATE = 200.0  # public-key operations per second for one host, sustained
VERIFY_BURST = 800.0
SLOT_RATE = 50.0  # new slots per second that one host may add to the storage, sustained
SLOT_BURST = 400.0
# what a forged entry costs its source, on top of the checks it made us do: twice a host's
# burst, so its host's budget is in debt after it (refused for VERIFY_BURST / VERIFY_RATE s or
# more), and its subnet's after SUBNET_SHARE / 2 forgeries
FORGERY_PENALTY = 2 * VERIFY_BURST
