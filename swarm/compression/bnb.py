"""bitsandbytes blockwise quantization with its dynamic (non-linear) 8-bit code map.

On the CPU, ``bitsandbytes.functional.quantize_blockwise`` / ``dequantize_blockwise`` allocate a
fresh output on every call, and a fresh 100 MB buffer costs more in page faults than the
dequantization itself (measured on the 2-core reference CPU: 34 ms through the public function,
13 ms writing into a reused buffer, for 25M elements). So for fp32 on the CPU the library's own C
kernels are called directly with our reused buffers; everywhere else (CUDA, other dtypes, a
bitsandbytes build without those symbols) the public functions are used.

bitsandbytes is an optional dependency (``pip install 'swarm-train[bnb]'``); :func:`require` is
called when a codec of this method is built and refuses versions that are unsafe to call:
0.45.0-0.48.2 crash the interpreter on an all-zero block in the direct call, and 0.49.x misses
the int8 error bound.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any

import torch

from swarm.errors import ConfigError

MIN_VERSION = (0, 50, 0)
_CODE_MAPS: dict[torch.device, torch.Tensor] = {}


def require() -> None:
    """Raise ConfigError unless a bitsandbytes that is safe to call is installed."""
    try:
        import bitsandbytes
    except (ImportError, OSError, RuntimeError) as e:  # missing, or its native library is
        raise ConfigError(
            f"int8 method 'bnb' needs bitsandbytes (pip install 'swarm-train[bnb]'): {e}"
        ) from e
    version = _version(getattr(bitsandbytes, "__version__", "0"))
    if version < MIN_VERSION:
        floor = ".".join(map(str, MIN_VERSION))
        raise ConfigError(
            f"bitsandbytes {bitsandbytes.__version__} is unsafe for int8 method 'bnb' "
            "(0.45-0.48 crash on an all-zero block, 0.49.x misses the int8 error bound); "
            f"pip install 'bitsandbytes>={floor}'"
        )


def _version(text: str) -> tuple[int, ...]:
    """``"0.49.1"``, ``"0.50.0.dev0"``, ``"0.49.1+cu12"`` -> (0, 49, 1); unparsable -> (0,)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in m.groups()) if m else (0,)


def code_map(device: torch.device) -> torch.Tensor:
    """The signed dynamic code map (256 sorted fp32 values in [-1, 1]) on ``device``."""
    code = _CODE_MAPS.get(device)
    if code is None:
        import bitsandbytes.functional as bnbf

        code = _CODE_MAPS[device] = bnbf.create_dynamic_map(signed=True).to(device)
    return code


def _cpu_kernel(name: str) -> Callable[..., Any] | None:
    """The C function ``name`` of bitsandbytes' CPU library, or None if this build lacks it."""
    try:
        from bitsandbytes.cextension import lib
    except ImportError:
        return None
    return getattr(lib, name, None)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def quantize(
    x: torch.Tensor, block_size: int, q: torch.Tensor, absmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat contiguous fp32 ``x``; returns (uint8 codes, fp32 per-block absmax).

    ``q`` (uint8, ``x.numel()``) and ``absmax`` (fp32, one per block) are reused buffers; they
    are filled and returned where the direct CPU kernel is available, otherwise the library's
    own outputs are returned. Note: the kernels skip NaN when taking block maxima, so callers
    must check the input for NaN themselves.
    """
    code = code_map(x.device)
    kernel = _cpu_kernel("cquantize_blockwise_cpu_fp32") if x.device.type == "cpu" else None
    if kernel is not None and x.dtype == torch.float32 and x.is_contiguous():
        kernel(
            _ptr(code),
            _ptr(x),
            _ptr(absmax),
            _ptr(q),
            ctypes.c_longlong(block_size),
            ctypes.c_longlong(x.numel()),
        )
        return q, absmax
    import bitsandbytes.functional as bnbf

    codes, state = bnbf.quantize_blockwise(x, code=code, blocksize=block_size)
    return codes, state.absmax


def dequantize(
    q: torch.Tensor, absmax: torch.Tensor, block_size: int, out: torch.Tensor
) -> torch.Tensor:
    """Write ``code[q] * absmax(block)`` into flat contiguous fp32 ``out`` and return it.

    The caller has checked that ``absmax`` is finite and non-negative and that the lengths
    match (``q.numel() == out.numel()``, one absmax per block).
    """
    code = code_map(out.device)
    kernel = _cpu_kernel("cdequantize_blockwise_cpu_fp32") if out.device.type == "cpu" else None
    if kernel is not None and out.dtype == torch.float32 and out.is_contiguous():
        q, absmax = q.contiguous(), absmax.contiguous()
        kernel(
            _ptr(code),
            _ptr(q),
            _ptr(absmax),
            _ptr(out),
            ctypes.c_longlong(block_size),
            ctypes.c_longlong(out.numel()),
        )
        return out
    import bitsandbytes.functional as bnbf

    dec = bnbf.dequantize_blockwise(q, absmax=absmax, code=code, blocksize=block_size)
    return out.copy_(dec.view(-1))
