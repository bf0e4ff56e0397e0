"""``int4_channel``: channel-wise symmetric INT4 for Q / K / V."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    Codec,
    Encoded,
    register,
)
from .int4 import (
    as_rows_f32,
    finite_absmax,
    flagged_scale,
    int4_nbytes,
    int4_values,
    nonfinite_any,
    pack_int4,
    quantize_sym,
    rows_channels,
    unpack_nibbles,
)


@register
class Int4ChannelCodec(Codec):
    """Per channel (last dim) ``scale = max_rows |x| / 8`` (float32, paper's formula).

    ``q = clamp(round_half_even(x / scale), -8, 7)`` (so ``+8 * scale`` clips to 7);
    ``scale == 0`` gives q = 0. Decode ``q * scale``. Payload: ``q`` packed nibbles of the
    [rows, C] codes, ``scale`` float32 [C]. A channel holding inf / NaN is flagged (``absmax /
    6``, sign bit set; see ``base``).
    """

    name = "int4_channel"
    lossless = False

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        xf = as_rows_f32(x)
        flag = nonfinite_any(xf, 0)
        scale = flagged_scale(finite_absmax(xf, 0), flag, 8.0)
        q = quantize_sym(xf, scale.abs())
        return {"q": pack_int4(q), "scale": scale.contiguous()}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        rows, channels = rows_channels(enc.shape)
        nib = unpack_nibbles(enc.tensors["q"], rows * channels).reshape(rows, channels)
        s = enc.tensors["scale"]
        return (int4_values(nib, torch.signbit(s)) * s.abs()).to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + channels * 4
