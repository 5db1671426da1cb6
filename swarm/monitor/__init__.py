"""See the swarm: progress in peer records, status tables, Prometheus metrics, a web dashboard.

- :mod:`~swarm.monitor.resources`: what this machine is (CPU, RAM, GPU), portably.
- :mod:`~swarm.monitor.tracker`: turns a peer's counters into the :class:`~swarm.net.progress.
  Progress` it publishes at each heartbeat.
- :mod:`~swarm.monitor.watch`: "peer X joined (N peers)" / "peer X left" log lines.
- :mod:`~swarm.monitor.metrics`: a per-peer Prometheus registry served at ``/metrics``.
- :mod:`~swarm.monitor.status`: reads every record of a run; the ``swarm-peer status`` table.
- :mod:`~swarm.monitor.dashboard`: ``swarm-peer dashboard``, one self-contained web page.
"""
