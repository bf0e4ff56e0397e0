"""Helpers of the block-scaled library formats (:mod:`.bnb`, :mod:`.mx`): whole blocks along the
last dim as views, NaN and bfloat16 bits, nibble packing.

Why parts and not padding: a reference computed on zero-padded blocks and sliced afterwards, or
gathering per-block values with ``arange(n) // block``, is what torch 2.13's inductor compiles
wrong on a CPU when ``block`` does not divide ``n`` (it splits the loop into ``n // block`` whole
blocks and never writes the rest). Every reference here works on the whole blocks and the
partial last block as separate views and joins the results with ``torch.cat``.
"""

from __future__ import annotations

import functools
import math

import torch

E4M3_NAN = 0x7F  # the code a reference writes for every NaN (positive sign)


def block_parts(t: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Views of ``t`` [..., n] in blocks along the last dim: [..., n // block, block] for the
    whole blocks (if any), then [..., 1, n % block] for a partial last block (if any)."""
    n = t.shape[-1]
    full = n - n % block
    parts = []
    if full:
        parts.append(t[..., :full].reshape(*t.shape[:-1], full // block, block))
    if n % block:
        parts.append(t[..., full:].unsqueeze(-2))
    return parts


def join(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """``torch.cat`` along ``dim`` (the tensor itself when there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def join_blocks(parts: list[torch.Tensor]) -> torch.Tensor:
    """[..., k, w] block parts back to [..., n]."""
    return join([p.flatten(-2) for p in parts])


def split_like(stats: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-block ``stats`` [..., n_blocks] split to match ``parts`` (as [..., k, 1])."""
    sizes = [p.shape[-2] for p in parts]
    return [s.unsqueeze(-1) for s in stats.split(sizes, dim=-1)]


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN the canonical quiet NaN (0x7FC00000): a reduction's NaN bits depend
    on how it was vectorised (bitsandbytes' full ``max()`` gives 0xFFFFFFFF)."""
    return torch.where(torch.isnan(t), math.nan, t)


@functools.cache
def e4m3_values(device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of each float8_e4m3fn byte (its two NaNs the canonical NaN)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return canonical_nan(values.to(torch.float32)).to(device)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of float32 ``y`` (round to nearest even; ``y`` within +-448 or NaN),
    every NaN the code 0x7F: a NaN's sign is whatever the arithmetic left (vectorised and
    scalar code differ), the libraries' casts keep it."""
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), E4M3_NAN, q).view(torch.float8_e4m3fn)


def e4m3_decode(q: torch.Tensor) -> torch.Tensor:
    """float32 values of float8_e4m3fn codes ``q`` (a table lookup: NaNs canonical)."""
    idx = q.view(torch.uint8).to(torch.int64).reshape(-1)
    return e4m3_values(q.device).index_select(0, idx).reshape(q.shape)


def to_bf16_bits(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` to bfloat16 by adding ``0x7FFF + lsb`` to the bits and truncating, as
    bitsandbytes' CPU library casts: round to nearest even, a NaN keeps its sign (torch's cast
    writes a NaN of its own)."""
    b = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return r.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def pack_pairs(q: torch.Tensor, pad: int, high_first: bool) -> torch.Tensor:
    """uint8 codes [..., n] -> bytes [..., ceil(n / 2)]: element ``2i`` in the high nibble of
    byte ``i`` (``high_first``, bitsandbytes) or in the low one (torchao); an odd count pads the
    code ``pad``."""
    first, second = q[..., 0::2], q[..., 1::2]
    if q.shape[-1] % 2:
        second = torch.cat([second, second.new_full((*q.shape[:-1], 1), pad)], dim=-1)
    if high_first:
        return ((first << 4) | second).contiguous()
    return (first | (second << 4)).contiguous()


def unpack_pairs(packed: torch.Tensor, n: int, high_first: bool) -> torch.Tensor:
    """Inverse of :func:`pack_pairs`: the first ``n`` codes of each row, uint8 [..., n]."""
    hi, lo = packed >> 4, packed & 0x0F
    first, second = (hi, lo) if high_first else (lo, hi)
    pairs = n // 2
    codes = torch.stack([first[..., :pairs], second[..., :pairs]], dim=-1).flatten(-2)
    if n % 2:
        codes = torch.cat([codes, first[..., pairs:]], dim=-1)
    return codes
