"""See the swarm: progress in peer records, progress tracking, Prometheus metrics, join/leave watch.

- :mod:`~swarm.monitor.resources`: what this machine is (CPU, RAM, GPU), portably.
- :mod:`~swarm.monitor.tracker`: turns a peer's counters into the :class:`~swarm.net.progress.
  Progress` it publishes at each heartbeat.
- :mod:`~swarm.monitor.watch`: "peer X joined (N peers)" / "peer X left" log lines.
- :mod:`~swarm.monitor.metrics`: a per-peer Prometheus registry served at ``/metrics``.

The views built on these (the ``swarm-peer status`` table, the web dashboard) sit above the peer,
in :mod:`swarm.dashboard`.
"""
