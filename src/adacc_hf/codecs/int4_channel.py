"""``int4_channel``: channel-wise symmetric INT4 for Q / K / V."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import dispatch
from .base import (
    Codec,
    Encoded,
    as_rows_f32,
    int4_nbytes,
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
    [rows, C] codes, ``scale`` float32 [C].
    """

    name = "int4_channel"
    lossless = False

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        if dispatch.use_kernel(x):
            return dispatch.encode(self, x)
        xf = as_rows_f32(x)
        scale = xf.abs().amax(dim=0) / 8
        q = pack_int4(quantize_sym(xf, scale))
        return Encoded(self.name, x.shape, x.dtype, {"q": q, "scale": scale.contiguous()}, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        self._check_encoded(enc)
        if dispatch.use_kernel(enc.device):
            return dispatch.decode(self, enc)
        rows, channels = rows_channels(enc.shape)
        q = unpack_int4(enc.tensors["q"], rows * channels).reshape(rows, channels)
        return (q.to(torch.float32) * enc.tensors["scale"]).to(enc.dtype).reshape(enc.shape)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + channels * 4
