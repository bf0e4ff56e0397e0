"""``int4_channel``: channel-wise symmetric INT4 for Q / K / V."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    Codec,
    Encoded,
    as_rows_f32,
    divisor,
    flag_scale,
    int4_markers,
    int4_nbytes,
    int4_unmark,
    pack_int4,
    quantize_sym,
    register,
    rows_channels,
    unpack_int4,
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
        finite = torch.isfinite(xf)
        xs = torch.where(finite, xf, 0.0)
        flag = ~finite.all(dim=0)
        scale = xs.abs().amax(dim=0) / divisor(flag, 8.0)
        q = torch.where(finite, quantize_sym(xs, scale), int4_markers(xf))
        return {"q": pack_int4(q), "scale": flag_scale(scale, flag).contiguous()}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        rows, channels = rows_channels(enc.shape)
        q = unpack_int4(enc.tensors["q"], rows * channels).reshape(rows, channels)
        s = enc.tensors["scale"]
        x = int4_unmark(q.to(torch.float32) * s.abs(), q, torch.signbit(s))
        return x.to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + channels * 4
