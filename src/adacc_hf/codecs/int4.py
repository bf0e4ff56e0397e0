"""Shared INT4 helpers: rows x channels views, nibble packing, symmetric and grouped quantisation
with flagged (non-finite) segments. The conventions are `adacc_hf.codecs.base`'s.

INT4 nibble layout (:func:`pack_int4`): the int8 codes ``q`` in [-8, 7] are flattened
(row-major) and stored as unsigned nibbles ``q + 8`` in 0..15. Element ``2i`` goes to the LOW
nibble of byte ``i`` and element ``2i + 1`` to the HIGH nibble. An odd count is padded with
``q = 0`` (nibble ``8``). Example: ``[-8, 7, 0, 1, -1]`` -> ``[0xF0, 0x98, 0x87]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from adacc_kernels.layout import group_layout

from .base import CodecError

# Codes that mark non-finite elements in a flagged INT4 segment (finite ones use [-6, 6]).
MARK_NEG_INF, MARK_NAN, MARK_POS_INF = -8, -7, 7
FLAGGED_LEVELS = 6.0


def rows_channels(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, channels) view of ``shape``: channels = last dim, rows = the rest flattened."""
    channels = int(shape[-1]) if len(shape) > 0 else 1
    return math.prod(shape) // channels, channels


def as_rows_f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a float32 [rows, channels] tensor (may share storage with ``x``: read only)."""
    rows, channels = rows_channels(x.shape)
    return x.reshape(rows, channels).to(torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] into uint8 nibbles (layout in the module docstring)."""
    if q.dtype != torch.int8:
        raise CodecError(f"pack_int4 needs int8 codes, got {q.dtype}")
    nib = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_full((1,), 8)])
    return (nib[0::2] | (nib[1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: the first ``numel`` int8 codes, flat."""
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        raise CodecError(
            f"unpack_int4: expected {(numel + 1) // 2} uint8 bytes, "
            f"got {packed.numel()} x {packed.dtype}"
        )
    nib = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:numel]
    return (nib.to(torch.int16) - 8).to(torch.int8)


def int4_nbytes(numel: int) -> int:
    return (numel + 1) // 2


# -- non-finite handling (see the module docstring) ---------------------------------------

FLT_MIN = torch.finfo(torch.float32).tiny  # a flagged segment's smallest scale magnitude


def finite_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Max of ``|x|`` over the finite elements along ``dim`` (0 where there are none)."""
    return x.abs().nan_to_num_(0.0, 0.0, 0.0).amax(dim=dim)


def nonfinite_any(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether each segment along ``dim`` holds an inf or NaN (it is then flagged)."""
    return ~torch.isfinite(x).all(dim=dim)


def flagged_scale(
    spread: torch.Tensor, flag: torch.Tensor, normal: float, flagged: float = FLAGGED_LEVELS
) -> torch.Tensor:
    """Per-segment float32 scale ``spread / normal`` (``spread / flagged``, at least FLT_MIN, with
    the sign bit set, where ``flag``). The divisor is a device tensor, so the division is IEEE
    on CUDA too (not a multiply by a reciprocal)."""
    scale = spread / torch.where(flag, flagged, normal).to(torch.float32)
    scale = torch.where(flag & (scale == 0), FLT_MIN, scale)
    return torch.where(flag, -scale, scale)


def quantize_sym(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round_half_even(x / scale), -8, 7)`` as int8 (``scale`` >= 0, broadcastable).

    A zero scale divides by 1 (its finite elements are all 0). Non-finite ``x`` become their
    markers on the way: -inf and +inf clamp to -8 and 7, NaN becomes -7.
    """
    q = torch.round(x / torch.where(scale == 0, 1.0, scale))
    return q.clamp_(-8, 7).nan_to_num_(float(MARK_NAN)).to(torch.int8)


@functools.cache
def _code_values(device: torch.device) -> torch.Tensor:
    """float32 [32]: the value of nibble ``n`` (``n - 8``), then of nibble ``n`` in a flagged
    segment (markers: -inf, NaN, +inf)."""
    flagged = [float(c) for c in range(-8, 8)]
    flagged[0], flagged[1], flagged[15] = -math.inf, math.nan, math.inf
    return torch.tensor([float(c) for c in range(-8, 8)] + flagged, device=device)


def int4_values(nib: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """float32 code values of uint8 nibbles ``nib``; ``flag`` (broadcastable) marks flagged
    segments, whose marker codes become -inf / NaN / +inf (times any finite scale)."""
    idx = nib.to(torch.int32) + (flag.to(torch.int32) << 4)
    return _code_values(nib.device).index_select(0, idx.reshape(-1)).reshape(idx.shape)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` nibbles (``q + 8``, uint8) of packed INT4 codes, flat."""
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        raise CodecError(
            f"unpack_int4: expected {(numel + 1) // 2} uint8 bytes, "
            f"got {packed.numel()} x {packed.dtype}"
        )
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:numel]


def quantize_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 of float32 [rows, C] in groups of ``group_size`` along the last dim.

    The last dim is zero-padded to a multiple of the group (``group_size == 0``: whole row).
    Per group ``scale = absmax / 7`` (float32; flagged groups ``absmax / 6``, sign bit set).
    Returns (packed uint8 of the padded [rows, Cp] codes, scale [rows, Cp // group]).
    """
    rows, channels = x.shape
    group, padded = group_layout(channels, group_size)
    if padded != channels:
        x = torch.nn.functional.pad(x, (0, padded - channels))
    xg = x.reshape(rows, padded // group, group)
    flag = nonfinite_any(xg, -1)
    scale = flagged_scale(finite_absmax(xg, -1), flag, 7.0)
    q = quantize_sym(xg, scale.abs().unsqueeze(-1))
    return pack_int4(q), scale.contiguous()


def dequantize_groups(
    packed: torch.Tensor, scale: torch.Tensor, channels: int, group_size: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: float32 [rows, channels] = q * |scale|."""
    rows, _ = scale.shape
    group, padded = group_layout(channels, group_size)
    nib = unpack_nibbles(packed, rows * padded).reshape(rows, padded)[:, :channels]
    s = per_column(scale, channels, group)
    return int4_values(nib, torch.signbit(s)) * s.abs()


def per_column(segments: torch.Tensor, channels: int, width: int) -> torch.Tensor:
    """[rows, channels]: each channel's value of ``segments`` [rows, ceil(C / width)] (one per
    run of `width` channels). Decoders scale the unpadded columns with it: computing on padded
    segments and slicing the pad off afterwards is what torch 2.13's inductor compiles wrong on a
    CPU (the last segment), so every backend computes this way."""
    idx = torch.arange(channels, device=segments.device) // width
    return segments.index_select(1, idx)


def groups_nbytes(rows: int, channels: int, group_size: int) -> int:
    group, padded = group_layout(channels, group_size)
    return int4_nbytes(rows * padded) + rows * (padded // group) * 4
