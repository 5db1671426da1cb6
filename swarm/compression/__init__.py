"""Compression codecs with error feedback.

Every codec turns a float32/float16/bfloat16 tensor into a self-describing payload
(:mod:`swarm.compression.header`) and back, on the tensor's own device::

    codec = get_codec("topk:0.01")
    payload = codec.encode(tensor)                  # bytes
    restored = decode(payload, device="cpu")        # original dtype and shape
    decode_into(payload, accumulator, weight=0.5)   # accumulator += 0.5 * D(payload)

    ef = ErrorFeedback(codec)                       # one per tensor or averaging slot
    payload = ef.encode(tensor)                     # what the codec drops is sent later

Codecs: ``none`` (exact), ``fp16``, ``bf16`` (:mod:`~swarm.compression.floats`), ``int8``
(blockwise; :mod:`~swarm.compression.int8`, bitsandbytes' map in
:mod:`~swarm.compression.bnb`), ``topk`` (exact top-K with compact indices;
:mod:`~swarm.compression.topk`, :mod:`~swarm.compression.indices`), ``1bit`` (signs + per-block
mean magnitude; :mod:`~swarm.compression.onebit`), ``sparse`` (top-k inside chunks, 2-bit values;
:mod:`~swarm.compression.sparse`). Shared parts: the codec interface
(:mod:`~swarm.compression.base`), the payload header (:mod:`~swarm.compression.header`), blocks
and bits (:mod:`~swarm.compression.blocks`, :mod:`~swarm.compression.bits`), lookup by spec
(:mod:`~swarm.compression.codecs`, :mod:`~swarm.compression.spec`), error feedback
(:mod:`~swarm.compression.feedback`). Encoding refuses inf/NaN with a
:class:`~swarm.errors.CompressionError` naming their count, so a diverged peer cannot poison the
others; decoding validates every header field before allocating and raises the same error type
for any malformed or hostile payload.
"""

from swarm.compression.base import Codec
from swarm.compression.codecs import CODEC_NAMES, decode, decode_into, get_codec, read_header
from swarm.compression.feedback import ErrorFeedback
from swarm.compression.floats import CastCodec
from swarm.compression.header import DEFAULT_MAX_NUMEL, Header
from swarm.compression.int8 import Int8Codec
from swarm.compression.onebit import OneBitCodec
from swarm.compression.topk import TopKCodec

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_MAX_NUMEL",
    "CastCodec",
    "Codec",
    "ErrorFeedback",
    "Header",
    "Int8Codec",
    "OneBitCodec",
    "TopKCodec",
    "decode",
    "decode_into",
    "get_codec",
    "read_header",
]
