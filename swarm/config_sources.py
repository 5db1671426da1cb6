"""Where a facade's config comes from: keywords, then ``SWARM_*`` variables, then defaults.

``Swarm``, ``AsyncSwarm``, ``SwarmOptimizer`` and ``NodeSwarm`` all build their config here, with
one routing rule (:meth:`~swarm.config.SwarmConfig.build`): a keyword names any field of the
tree. A field not given reads its environment variable: a peer's field the one ``swarm-peer``
reads (:mod:`swarm.peer_flags`), any other ``SWARM_<FIELD>``.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.config import SwarmConfig
from swarm.errors import ConfigError
from swarm.options import environment_options, leaf_fields
from swarm.peer_config import PeerConfig
from swarm.peer_flags import environment_fields


def environment() -> dict[str, Any]:
    """The fields ``SWARM_*`` variables set: a peer's through :mod:`swarm.peer_flags` (the
    variables ``swarm-peer`` reads, with its units), the others as ``SWARM_<FIELD>``."""
    peer_fields = set(leaf_fields(PeerConfig))
    return {**environment_options(SwarmConfig, skip=peer_fields), **environment_fields()}


def facade_config(
    model: torch.nn.Module, config: SwarmConfig | None, options: dict[str, Any]
) -> SwarmConfig:
    """The config of a facade: ``config`` as given, or the keyword ``options`` over the
    ``SWARM_*`` environment variables (:func:`environment`), routed to the config that owns each one
    (:meth:`SwarmConfig.build`); the peer's ``device`` label comes from the model unless given.

    Raises:
        ConfigError: both ``config`` and options, an unknown option (the message names the
            closest valid one), or an invalid value.
    """
    if config is not None:
        if options:
            raise ConfigError(
                f"pass either config= or individual options, not both (got {sorted(options)})"
            )
        if not isinstance(config, SwarmConfig):
            raise ConfigError(f"config must be a SwarmConfig, got {type(config).__name__}")
        return config
    merged = {**environment(), **options}
    merged.setdefault("device", device_label(model))
    return SwarmConfig.build(**merged)


def device_label(model: torch.nn.Module) -> str:
    """What a peer training ``model`` shows others: ``cpu`` or ``cuda:GPU NAME``."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_name(p.device)}"
