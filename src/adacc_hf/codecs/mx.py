"""``mxfp8`` and ``mxfp4``: OCP microscaling (MX) formats as torchao casts them, with torchao's
own casts as a backend (``"torchao"``).

One e8m0 scale (a power of two, stored as its biased exponent byte) per block of 32 channels
along the last dim; elements in float8 e4m3fn (``mxfp8``) or FP4 e2m1 (``mxfp4``). The
references reproduce ``torchao.prototype.mx_formats.mx_tensor.to_mx`` (its default FLOOR scale
calculation) and ``to_dtype`` (torchao 0.18) bit for bit. torchao's casts are plain torch, so
the backend runs wherever torch does (checked on CPU and CUDA). A last dim that is not a multiple
of 32 is zero-padded to whole blocks (zeros leave a block's scale unchanged); the payload keeps
only the real channels.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import backends
from .base import Codec, Encoded, register
from .blockwise import (
    block_parts,
    e4m3_decode,
    join,
    join_blocks,
    pack_pairs,
    split_like,
    to_e4m3,
    unpack_pairs,
)
from .int4 import as_rows_f32, rows_channels
from .library import library_check

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126
FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 codes 0..15 (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@functools.cache
def _fp4_values(device: torch.device) -> torch.Tensor:
    v = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return torch.cat([v, -v]).to(device)


def e8m0_scale(biased: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** (biased - 127)`` of e8m0 bytes (0 gives the subnormal 2^-127; 255 NaN),
    built from its bits: what torchao's ``get_fp_scale`` computes with ``pow``."""
    b = biased.to(torch.int32)
    s = torch.where(b == 0, 1 << 22, b << 23).view(torch.float32)
    return torch.where(b == E8M0_NAN, math.nan, s)


def f32_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes of float32 ``y``: round to nearest even, saturating at +-6 (torchao's
    ``f32_to_f4_unpacked``, the same integer steps). A NaN takes code 0 (torchao: whatever
    code its bits give; NaNs only reach the cast in NaN blocks, which decode to NaN)."""
    bits = y.view(torch.int32)
    sign = bits & -0x80000000
    a = (bits ^ sign).view(torch.float32)
    saturate = a >= FP4_MAX
    denormal = ~saturate & (a < 1.0)
    normal = ~(saturate | denormal)
    # below 1: adding 2^22 rounds to the 0.5 grid in the float unit (half to even)
    sub = ((a + 4194304.0).view(torch.int32) - (149 << 23)).to(torch.uint8)
    n = a.view(torch.int32)
    odd = (n >> 22) & 1
    n = ((n + ((1 - 127) << 23) + 0x1FFFFF + odd) >> 22).to(torch.uint8)
    code = torch.where(normal, n, torch.where(denormal, sub, 7))
    code = code | ((sign >> 28).to(torch.uint8) & 0x8)
    return torch.where(torch.isnan(y), 0, code).to(torch.uint8)


class _Mx(Codec):
    """Per row and block of 32 channels (FLOOR scales): ``e = floor(log2(max |x|)) - emax``, read
    from the exponent bits of ``max |x|`` (``2 ** emax`` is the element format's largest power of
    two: 256 for e4m3, 4 for e2m1), clamped to [-127, 128] and stored biased (``e + 127``, uint8;
    255 for a block whose max is NaN). ``y = x / max(2 ** e, 2 ** -126)`` (float32). Decode
    ``value(code) * 2 ** e`` (float32; ``e = -127`` decodes with 2^-127 although encode divided
    by 2^-126, as torchao does), one cast to the input dtype. torchao's ``to_mx`` takes bf16 and
    fp32; fp16 goes through an exact fp32 upcast (torchao upcasts to fp32 itself).

    Non-finite inputs (torchao's behaviour): a block holding a NaN has scale byte 255 and decodes
    to NaN throughout; a block holding an inf (and no NaN) gets the scale of its max exponent
    (2^120 for e4m3, 2^126 for e2m1): its infs saturate to the largest code, whose value times
    that scale overflows float32, so they decode to +-inf; its other elements decode to 0.
    The profiler refuses such round trips (they are exact only at the infs). The code of a NaN
    element (in a NaN block) is 0x7F / 0 in the reference; torchao's cast leaves whatever the
    arithmetic gave there (the block decodes to NaN either way).
    """

    lossless = False
    emax = 0
    elem = ""

    def _scaled(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(y = x / scale as float32 block parts [rows, k, w], biased e8m0 uint8 [rows, nb])."""
        parts = block_parts(as_rows_f32(x), BLOCK)
        ys, biased = [], []
        for part in parts:
            max_abs = part.abs().amax(-1)
            e = ((max_abs.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS - self.emax
            b = (e.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS).to(torch.uint8)
            b = torch.where(torch.isnan(max_abs), E8M0_NAN, b).to(torch.uint8)
            scale = (b.to(torch.int32) << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
            ys.append(part / scale[..., None])
            biased.append(b)
        return ys, join(biased)

    def _values(self, enc: Encoded, rows: int, channels: int) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:
        rows, channels = rows_channels(enc.shape)
        parts = block_parts(self._values(enc, rows, channels), BLOCK)
        scales = split_like(e8m0_scale(enc.tensors["scale"]), parts)
        y = join_blocks([v * s for v, s in zip(parts, scales, strict=True)])
        return y.to(enc.dtype)

    def _code_nbytes(self, rows: int, channels: int) -> int:
        raise NotImplementedError

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return self._code_nbytes(rows, channels) + rows * -(-channels // BLOCK)


@register
class Mxfp8Codec(_Mx):
    __doc__ = (
        "``mxfp8``: MX with float8 e4m3fn elements, ``q = e4m3(clamp(y, -448, 448))`` (round "
        "to nearest even). Payload: ``q`` float8_e4m3fn [rows, C], ``scale`` uint8 [rows, "
        "ceil(C / 32)]. " + (_Mx.__doc__ or "")
    )
    name = "mxfp8"
    emax = 8
    elem = "float8_e4m3fn"

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        ys, biased = self._scaled(x)
        q = join_blocks([to_e4m3(y.clamp(-FP8_MAX, FP8_MAX)) for y in ys])
        return {"q": q.contiguous(), "scale": biased.contiguous()}, {}

    def _values(self, enc: Encoded, rows: int, channels: int) -> torch.Tensor:
        return e4m3_decode(enc.tensors["q"])

    def _code_nbytes(self, rows: int, channels: int) -> int:
        return rows * channels


@register
class Mxfp4Codec(_Mx):
    __doc__ = (
        "``mxfp4``: MX with FP4 e2m1 elements (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; round to nearest "
        "even, saturating at +-6). Payload: ``q`` uint8 [rows, ceil(C / 2)] (torchao's packing: "
        "channel ``2i`` in the LOW nibble of byte ``i``; an odd C pads the code of 0), ``scale`` "
        "uint8 [rows, ceil(C / 32)]. " + (_Mx.__doc__ or "")
    )
    name = "mxfp4"
    emax = 2
    elem = "float4_e2m1fn_x2"

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        ys, biased = self._scaled(x)
        q = pack_pairs(join_blocks([f32_to_e2m1(y) for y in ys]), 0, high_first=False)
        return {"q": q, "scale": biased.contiguous()}, {}

    def _values(self, enc: Encoded, rows: int, channels: int) -> torch.Tensor:
        q = enc.tensors["q"]
        nib = unpack_pairs(q, channels, high_first=False).to(torch.int64)
        return _fp4_values(q.device).index_select(0, nib.reshape(-1)).reshape(rows, channels)

    def _code_nbytes(self, rows: int, channels: int) -> int:
        return rows * ((channels + 1) // 2)


# -- the torchao backend -----------------------------------------------------------------

_MX_MODULE = "torchao.prototype.mx_formats.mx_tensor"


def _torchao_encode(codec: _Mx, x: torch.Tensor) -> tuple[dict, dict]:
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    rows, channels = rows_channels(x.shape)
    padded = -(-channels // BLOCK) * BLOCK
    xr = x.reshape(rows, channels)
    if xr.dtype == torch.float16:  # to_mx takes bf16 / fp32 and upcasts to fp32 itself: exact
        xr = xr.to(torch.float32)
    if padded != channels:
        xr = F.pad(xr, (0, padded - channels))
    scale, data = to_mx(xr, getattr(torch, codec.elem), BLOCK)
    width = channels if codec.name == "mxfp8" else (channels + 1) // 2
    q = data.reshape(rows, -1)[:, :width].contiguous()
    return {"q": q, "scale": scale.view(torch.uint8).reshape(rows, -1)}, {}


def _torchao_decode(codec: _Mx, enc: Encoded) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype

    rows, channels = rows_channels(enc.shape)
    padded = -(-channels // BLOCK) * BLOCK
    q = enc.tensors["q"]
    full = padded if codec.name == "mxfp8" else padded // 2
    if q.shape[-1] != full:
        q = F.pad(q.view(torch.uint8), (0, full - q.shape[-1])).view(q.dtype)
    # an fp16 target would overflow torchao's fp16 scale (2^16 and up): decode in float32
    target = torch.float32 if enc.dtype == torch.float16 else enc.dtype
    scale = enc.tensors["scale"].view(torch.float8_e8m0fnu)
    y = to_dtype(q, scale, getattr(torch, codec.elem), BLOCK, target)
    return y.reshape(rows, padded)[:, :channels].to(enc.dtype)


for _name in ("mxfp8", "mxfp4"):
    backends.register_backend(
        _name,
        "torchao",
        backends.LibraryBackend(
            _torchao_encode,
            _torchao_decode,
            library_check(
                [_MX_MODULE],
                "0.18",
                ["cpu", "cuda"],
                "torchao's MX casts are checked on CPU and CUDA",
            ),
        ),
    )
