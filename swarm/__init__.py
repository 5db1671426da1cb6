"""swarm: train one PyTorch model on many ordinary machines over the internet, no central server."""

from swarm.errors import SwarmError
from swarm.version import __version__

__all__ = ["SwarmError", "__version__"]
