"""``nf4``, ``fp4`` and ``int8_blockwise``: bitsandbytes' blockwise formats, with bitsandbytes'
own functions as a backend (``"bitsandbytes"``, :mod:`.bnb_backend`).

bitsandbytes quantises the *flattened* row-major tensor in blocks of ``blocksize`` elements
(one float32 ``absmax`` per block, the last block partial), not per channel. The references
below reproduce bitsandbytes 0.50's CPU code bit for bit: 4-bit quantisation is its ``default``
torch kernel (``backends/default/ops.py``), 4-bit dequantisation and all of the 8-bit code are
its native CPU library (``csrc/cpu_ops.cpp``). Its CUDA kernels round differently (a zero
block, the last partial block, FP4 zero signs, the 8-bit search), so the library backend runs on
CPU only; on a GPU the reference compiled by inductor runs the format. The references decode to
bfloat16 as bitsandbytes' CPU library does (:func:`.blockwise.to_bf16_bits`: NaNs keep their
sign).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .base import Codec, CodecError, Encoded, register
from .blockwise import (
    block_parts,
    canonical_nan,
    join,
    join_blocks,
    pack_pairs,
    split_like,
    to_bf16_bits,
    unpack_pairs,
)

BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZES_8BIT = (64, 128, 256, 512, 1024, 2048, 4096)
ABSMAX_FLOOR = 1e-38  # bitsandbytes' clamp of a 4-bit block's absmax before its reciprocal

# bitsandbytes' 4-bit code values (``functional.get_4bit_type``), in code order.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# fmt: off
FP4_VALUES = (  # divided by 12 in float32
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
    -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
)
# fmt: on
# The codes in ascending value order (``torch.argsort`` of the FP4 values, as bitsandbytes
# sorts them: +0 (code 0) before -0 (code 8)).
ORDER = {"nf4": tuple(range(16)), "fp4": (11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3)}


@functools.cache
def _values_4bit(quant_type: str, device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code."""
    if quant_type == "nf4":
        return torch.tensor(NF4_VALUES, dtype=torch.float32).to(device)
    return (torch.tensor(FP4_VALUES, dtype=torch.float32) / 12.0).to(device)


@functools.cache
def _bounds_4bit(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [15] midpoints between consecutive sorted code values, int64 [16] order)."""
    order = torch.tensor(ORDER[quant_type])
    v = _values_4bit(quant_type, torch.device("cpu"))[order]
    return ((v[:-1] + v[1:]) / 2).to(device), order.to(device)


@functools.cache
def dynamic_code(device: torch.device) -> torch.Tensor:
    """float32 [256]: bitsandbytes' signed dynamic 8-bit map (``create_dynamic_map()``: 7
    exponent bits, sorted ascending, from -0.99297 to 1.0), built as bitsandbytes builds it."""
    data: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32).to(device)


@functools.cache
def dynamic_lut(device: torch.device) -> torch.Tensor:
    """uint8 [65536]: the native CPU quantiser's table. Bin ``i`` stands for the normalised value
    ``-1 + 2i / 65535`` and holds the code nearest to it (the count of code midpoints below)."""
    code = dynamic_code(torch.device("cpu"))
    mid = 0.5 * (code[:-1] + code[1:])
    val = -1.0 + (2.0 * torch.arange(65536, dtype=torch.float32)) / 65535.0
    return torch.searchsorted(mid, val, side="left").to(torch.uint8).to(device)


def to_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``y`` cast as bitsandbytes' CPU library casts (bfloat16: :func:`to_bf16_bits`)."""
    return to_bf16_bits(y) if dtype == torch.bfloat16 else y.to(dtype)


def _check_blocksize(name: str, blocksize: int, allowed: tuple[int, ...]) -> int:
    if isinstance(blocksize, bool) or blocksize not in allowed:
        raise CodecError(f"{name}: blocksize must be one of {allowed}, got {blocksize!r}")
    return int(blocksize)


class _Blockwise4bit(Codec):
    """bitsandbytes' blockwise 4-bit quantisation of the flattened tensor (``quantize_4bit`` /
    ``dequantize_4bit``, no double quantisation).

    Per block of ``blocksize`` elements (the last one partial): ``absmax = max |x|`` (float32);
    ``y = x * (1 / max(absmax, 1e-38))`` (reciprocal, then multiply; the last *partial* block
    divides, ``x / max(absmax, 1e-38)``, and stores that clamped absmax), ``y`` clamped to
    [-1, 1]; its rank among the midpoints of consecutive sorted code values (``torch.bucketize``:
    a tie goes to the lower value) names the code (:data:`ORDER`). Decode ``value[code] * absmax``
    in float32, one cast to the input dtype. Payload: ``q`` uint8 [ceil(n / 2)], element ``2i`` in
    the HIGH nibble of byte ``i`` and ``2i + 1`` in the low one (an odd count pads the code of
    0); ``absmax`` float32 [ceil(n / blocksize)].

    Non-finite inputs (bitsandbytes' behaviour, not the project's flagged segments): a block
    holding a NaN has a NaN absmax and decodes to NaN throughout; a block holding an inf has an
    inf absmax: its infs (either sign) take the top code and decode to +inf, its other elements
    become 0 and decode to NaN (0 * inf). The profiler refuses such round trips.
    """

    quant_type = ""
    lossless = False

    def __init__(self, blocksize: int = 64) -> None:
        self.blocksize = _check_blocksize(self.name, blocksize, BLOCKSIZES_4BIT)

    def params(self) -> dict:
        return {"blocksize": self.blocksize}

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        parts = block_parts(x.reshape(-1).to(torch.float32), self.blocksize)
        ys, absmax = [], []
        for part in parts:
            am = part.abs().amax(-1)
            safe = am.clamp(min=ABSMAX_FLOOR)
            if part.shape[-1] == self.blocksize:
                ys.append(part * safe.reciprocal()[:, None])
                absmax.append(am)
            else:  # the last partial block: divided, and its absmax kept clamped
                ys.append(part / safe[:, None])
                absmax.append(safe)
        y = join_blocks(ys).clamp(-1.0, 1.0)
        bounds, order = _bounds_4bit(self.quant_type, x.device)
        q = order.index_select(0, torch.bucketize(y, bounds)).to(torch.uint8)
        q = pack_pairs(q, ORDER[self.quant_type][7], high_first=True)  # pad: the code of 0
        return {"q": q, "absmax": canonical_nan(join(absmax))}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        q = enc.tensors["q"]
        nib = unpack_pairs(q, math.prod(enc.shape), high_first=True)
        values = _values_4bit(self.quant_type, q.device).index_select(0, nib.to(torch.int64))
        parts = block_parts(values, self.blocksize)
        absmax = split_like(enc.tensors["absmax"], parts)
        y = join_blocks([v * s for v, s in zip(parts, absmax, strict=True)])
        return to_dtype(y, enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        n = math.prod(shape)
        return (n + 1) // 2 + 4 * -(-n // self.blocksize)


@register
class Nf4Codec(_Blockwise4bit):
    __doc__ = "``nf4``: NormalFloat4 (QLoRA's data type). " + (_Blockwise4bit.__doc__ or "")
    name = "nf4"
    quant_type = "nf4"


@register
class Fp4Codec(_Blockwise4bit):
    __doc__ = (
        "``fp4``: bitsandbytes' FP4 (values +-{0, 0.0625, 2, 3, 4, 6, 8, 12} / 12). Codes 0 and 8 "
        "are both zero: a y in (-0.0026, 0] takes 0, one in (0, 0.0026] takes 8, which decodes "
        "to -0 as bitsandbytes' native CPU decoder has it (its ``get_4bit_type`` table, torch "
        "and AVX-512 decoders give +0). " + (_Blockwise4bit.__doc__ or "")
    )
    name = "fp4"
    quant_type = "fp4"


@register
class Int8BlockwiseCodec(Codec):
    """``int8_blockwise``: bitsandbytes' blockwise dynamic 8-bit quantisation of the flattened
    tensor (``quantize_blockwise`` / ``dequantize_blockwise``, the default dynamic map, the
    native CPU arithmetic).

    Per block of ``blocksize`` elements: ``absmax = max |x|`` over the non-NaN elements
    (float32); an all-zero block takes code 0 throughout (it decodes to -0.0); otherwise
    ``y = x * (1 / absmax)``, clamped to [-1, 1], selects the table bin
    ``trunc(((y + 1) * 0.5) * 65535 + 0.5)`` (float32 steps) and the code :func:`dynamic_lut`
    holds there: the code nearest to the bin's value, not always the nearest to ``y`` (0 itself
    takes code 131: ``2.125e-5 * absmax``). Decode ``code_value[q] * absmax`` in float32, one
    cast to the input dtype. Payload: ``q`` uint8 [n] (flat), ``absmax`` float32
    [ceil(n / blocksize)].

    Non-finite inputs (bitsandbytes' behaviour): the absmax ignores NaNs, a NaN takes code 0 and
    decodes to ``-0.99297 * absmax`` (a finite value where the block has no inf); a block holding
    an inf decodes to -inf at its infs and NaNs and +inf elsewhere. The profiler refuses such
    round trips.
    """

    name = "int8_blockwise"
    lossless = False

    def __init__(self, blocksize: int = 256) -> None:
        self.blocksize = _check_blocksize(self.name, blocksize, BLOCKSIZES_8BIT)

    def params(self) -> dict:
        return {"blocksize": self.blocksize}

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        parts = block_parts(x.reshape(-1).to(torch.float32), self.blocksize)
        absmax = [torch.where(torch.isnan(p), 0.0, p.abs()).amax(-1) for p in parts]
        ys = [
            (p * s.reciprocal()[:, None]).clamp(-1.0, 1.0)
            for p, s in zip(parts, absmax, strict=True)
        ]
        y = join_blocks(ys)
        pos = ((y + 1.0) * 0.5) * 65535.0 + 0.5
        pos = torch.where(torch.isnan(pos), 0.0, pos).to(torch.int64)  # NaN: bin 0
        q = block_parts(dynamic_lut(x.device).index_select(0, pos), self.blocksize)
        q = join_blocks(
            [torch.where(s[:, None] == 0, 0, c) for c, s in zip(q, absmax, strict=True)]
        )
        return {"q": q.to(torch.uint8), "absmax": join(absmax)}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        q = enc.tensors["q"]
        parts = block_parts(
            dynamic_code(q.device).index_select(0, q.to(torch.int64)), self.blocksize
        )
        absmax = split_like(enc.tensors["absmax"], parts)
        y = join_blocks([v * s for v, s in zip(parts, absmax, strict=True)])
        return to_dtype(y, enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        n = math.prod(shape)
        return n + 4 * -(-n // self.blocksize)
