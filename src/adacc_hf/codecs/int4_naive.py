"""``int4_naive``: the baseline per-token symmetric INT4, no outlier handling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import (
    Codec,
    Encoded,
    check_int_param,
    register,
)
from .int4 import (
    as_rows_f32,
    dequantize_groups,
    groups_nbytes,
    quantize_groups,
    rows_channels,
)


@register
class Int4NaiveCodec(Codec):
    """Symmetric INT4 per row (``group_size=0``) or per group of ``group_size`` channels.

    ``scale = absmax / 7`` (float32 per row/group), ``q = clamp(round_half_even(x / scale),
    -8, 7)``; decode ``q * scale``. Payload: ``q`` (packed nibbles of the [rows, Cp] codes,
    Cp = channels padded with zeros to a multiple of the group), ``scale`` [rows, Cp // group].
    """

    name = "int4_naive"
    lossless = False

    def __init__(self, group_size: int = 0) -> None:
        self.group_size = check_int_param(self.name, "group_size", group_size, 0)

    def params(self) -> dict[str, Any]:
        return {"group_size": self.group_size}

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        q, scale = quantize_groups(as_rows_f32(x), self.group_size)
        return {"q": q, "scale": scale}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        _, channels = rows_channels(enc.shape)
        x = dequantize_groups(enc.tensors["q"], enc.tensors["scale"], channels, self.group_size)
        return x.to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        return groups_nbytes(*rows_channels(shape), self.group_size)
