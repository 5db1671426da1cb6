"""A codec spec string, parsed once: what a config, the engine and the facade need to know of it.

``CodecSpec.parse("topk:0.01")`` checks the spec by building the codec (so a typo fails when a
config is built, not in a round) and answers the questions other layers used to answer by
splitting the text themselves: the codec's name, whether it is sparse, and whether it may
carry raw values (parameters, anchors) rather than changes only.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.compression.base import Codec
from swarm.compression.codecs import get_codec
from swarm.errors import ConfigError


@dataclass(frozen=True)
class CodecSpec:
    """A valid codec spec (see :func:`~swarm.compression.codecs.get_codec` for the forms)."""

    text: str  # the spec, normalized: "topk:0.01", "int8:4096:bnb"
    name: str  # the codec's name: "topk", "int8"
    sparse: bool  # keeps only what stands out; error feedback sends the rest later

    @classmethod
    def parse(cls, text: object) -> CodecSpec:
        """Parse and check ``text``.

        Raises:
            ConfigError: not a spec of a known codec, or an invalid option.
        """
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"codec must be a spec such as 'int8' or 'topk:0.01', got {text!r}")
        normalized = text.strip().lower()
        codec = get_codec(normalized)
        return cls(normalized, codec.name, codec.sparse)

    @property
    def dense_values_ok(self) -> bool:
        """It may average raw values (parameters, anchors): only a dense codec keeps them."""
        return not self.sparse

    def codec(self) -> Codec:
        """A codec built from this spec."""
        return get_codec(self.text)

    def __str__(self) -> str:
        return self.text
