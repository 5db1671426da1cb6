"""swarm: train one PyTorch model on many ordinary machines over the internet, no central server."""

from swarm.errors import SwarmError

__version__ = "0.1.0"

__all__ = ["SwarmError", "__version__"]
