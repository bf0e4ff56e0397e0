"""The ``"bitsandbytes"`` backend of :mod:`.bnb`'s codecs: bitsandbytes' own functions
(``quantize_4bit`` / ``dequantize_4bit``, ``quantize_blockwise`` / ``dequantize_blockwise``),
imported on first use.

CPU only: bitsandbytes' CUDA kernels round differently from its CPU code, which the references
follow (read in bitsandbytes' ``csrc/kernels.cu``: an all-zero 4-bit block takes code 0 there
(``0 * (1 / 0)`` is NaN) where the CPU path clamps the absmax to 1e-38; the last partial block
is multiplied by the reciprocal, not divided; FP4 codes a tiny positive value +0, not -0; the
8-bit quantiser searches the code map where the CPU library reads a 65536-bin table). The
8-bit CPU code is held to the reference on x86-64 only (aarch64 builds take NEON paths).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from . import backends
from .blockwise import canonical_nan
from .library import library_check, x86_64

Codec = Encoded = Any


def _bnb():
    import bitsandbytes.functional as bnb_functional

    return bnb_functional


def _encode_4bit(codec: Codec, x: torch.Tensor) -> tuple[dict, dict]:
    packed, state = _bnb().quantize_4bit(x, blocksize=codec.blocksize, quant_type=codec.quant_type)
    # a NaN absmax as the reference stores it: bitsandbytes' full max() of a partial block
    # gives 0xFFFFFFFF, its per-block max 0x7FC00000 (absmax is 1/blocksize of the payload)
    return {"q": packed.reshape(-1), "absmax": canonical_nan(state.absmax)}, {}


def _decode_4bit(codec: Codec, enc: Encoded) -> torch.Tensor:
    bnb = _bnb()
    n = math.prod(enc.shape)
    pairs = (n + 1) // 2
    # shape [pairs, 2]: the native kernel's flat (scalar) path, whatever n; its AVX-512 path
    # decodes FP4 code 8 as +0 (not -0) and indexes absmax per row (wrong where rows are not
    # whole blocks); an odd last dim would send it to a torch.compile'd fallback
    state = bnb.QuantState(
        absmax=enc.tensors["absmax"],
        shape=(pairs, 2),
        dtype=enc.dtype,
        blocksize=codec.blocksize,
        quant_type=codec.quant_type,
    )
    return bnb.dequantize_4bit(enc.tensors["q"].reshape(-1, 1), state).reshape(-1)[:n]


def _encode_8bit(codec: Codec, x: torch.Tensor) -> tuple[dict, dict]:
    q, state = _bnb().quantize_blockwise(x.reshape(-1), blocksize=codec.blocksize)
    return {"q": q, "absmax": state.absmax}, {}


@functools.cache
def _bnb_code(device: torch.device) -> torch.Tensor:
    return _bnb().create_dynamic_map().to(device)


def _decode_8bit(codec: Codec, enc: Encoded) -> torch.Tensor:
    bnb = _bnb()
    q = enc.tensors["q"]
    state = bnb.QuantState(
        absmax=enc.tensors["absmax"],
        code=_bnb_code(q.device),
        blocksize=codec.blocksize,
        dtype=enc.dtype,
    )
    return bnb.dequantize_blockwise(q, state)


def _native_library(device: torch.device) -> str | None:
    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

    if isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
        return "bitsandbytes' native CPU library did not load"
    return None


def _native_x86(device: torch.device) -> str | None:
    if not x86_64():
        return "bitsandbytes' 8-bit CPU code is checked bit for bit on x86-64 only"
    return _native_library(device)


_CPU_ONLY = (
    "bitsandbytes' GPU kernels round differently from its CPU code, which the reference "
    "follows: the bitsandbytes backend runs on CPU"
)
for _name, _impl in (
    ("nf4", (_encode_4bit, _decode_4bit, _native_library)),
    ("fp4", (_encode_4bit, _decode_4bit, _native_library)),
    ("int8_blockwise", (_encode_8bit, _decode_8bit, _native_x86)),
):
    backends.register_backend(
        _name,
        "bitsandbytes",
        backends.LibraryBackend(
            _impl[0],
            _impl[1],
            library_check(["bitsandbytes.functional"], "0.50", ["cpu"], _CPU_ONLY, _impl[2]),
        ),
    )
