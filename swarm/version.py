"""The version of swarm, in a module of its own so that any layer may read it without importing the
package root."""

__version__ = "0.1.0"
