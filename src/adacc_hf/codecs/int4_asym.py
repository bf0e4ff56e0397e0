"""``int4_asym``: per-row asymmetric INT4 for softmax / attention-score tensors."""

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
class Int4AsymCodec(Codec):
    """Per row (over the last dim): ``offset = (max + min) / 2``, ``scale = (max - min) / 16``.

    float32 each; ``q = clamp(round_half_even((x - offset) / scale), -8, 7)`` (q = 0 where
    ``scale == 0``); decode ``q * scale + offset`` (multiply, then add; no FMA). Payload:
    ``q`` packed nibbles of the [rows, C] codes, ``scale`` and ``offset`` float32 [rows].
    """

    name = "int4_asym"
    lossless = False

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        if dispatch.use_kernel(x):
            return dispatch.encode(self, x)
        xf = as_rows_f32(x)
        mn, mx = torch.aminmax(xf, dim=1)
        offset = (mx + mn) / 2
        scale = (mx - mn) / 16
        q = pack_int4(quantize_sym(xf - offset.unsqueeze(1), scale.unsqueeze(1)))
        tensors = {"q": q, "scale": scale.contiguous(), "offset": offset.contiguous()}
        return Encoded(self.name, x.shape, x.dtype, tensors, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        self._check_encoded(enc)
        if dispatch.use_kernel(enc.device):
            return dispatch.decode(self, enc)
        rows, channels = rows_channels(enc.shape)
        t = enc.tensors
        q = unpack_int4(t["q"], rows * channels).reshape(rows, channels).to(torch.float32)
        x = q * t["scale"].unsqueeze(1) + t["offset"].unsqueeze(1)
        return x.to(enc.dtype).reshape(enc.shape)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + rows * 8
