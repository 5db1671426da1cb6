"""Views of a whole run, read from the peers' records in the DHT.

- :mod:`~swarm.dashboard.status`: reads every record of a run; the ``swarm-peer status`` table.
- :mod:`~swarm.dashboard.web`: ``swarm-peer dashboard``, one self-contained web page.
- :mod:`~swarm.dashboard.commands`: the ``status`` and ``dashboard`` subcommands of ``swarm-peer``.
"""
