"""``int4_asym``: per-row asymmetric INT4 for softmax / attention-score tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import (
    Codec,
    Encoded,
    register,
)
from .int4 import (
    as_rows_f32,
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
class Int4AsymCodec(Codec):
    """Per row (over the last dim): ``offset = (max + min) / 2``, ``scale = (max - min) / 16``.

    float32 each; ``q = clamp(round_half_even((x - offset) / scale), -8, 7)`` (q = 0 where
    ``scale == 0``); decode ``q * scale + offset`` (multiply, then add; no FMA). Payload:
    ``q`` packed nibbles of the [rows, C] codes, ``scale`` and ``offset`` float32 [rows]. A row
    holding inf / NaN (e.g. ``-inf`` masked scores) is flagged: min / max over its finite
    elements, ``scale = (max - min) / 12`` with the sign bit set, markers for the rest (``base``).
    """

    name = "int4_asym"
    lossless = False

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        xf = as_rows_f32(x)
        flag = nonfinite_any(xf, 1)
        mx = xf.nan_to_num(nan=-math.inf, posinf=-math.inf).amax(dim=1)
        mn = xf.nan_to_num(nan=math.inf, neginf=math.inf).amin(dim=1)
        some = mx >= mn  # the row has a finite element
        mx, mn = torch.where(some, mx, 0.0), torch.where(some, mn, 0.0)
        offset = (mx + mn) / 2
        scale = flagged_scale(mx - mn, flag, 16.0, 12.0)
        q = quantize_sym(xf - offset.unsqueeze(1), scale.abs().unsqueeze(1))
        tensors = {"q": pack_int4(q), "scale": scale.contiguous(), "offset": offset.contiguous()}
        return tensors, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        rows, channels = rows_channels(enc.shape)
        t = enc.tensors
        nib = unpack_nibbles(t["q"], rows * channels).reshape(rows, channels)
        s = t["scale"].unsqueeze(1)
        x = int4_values(nib, torch.signbit(s)) * s.abs() + t["offset"].unsqueeze(1)
        return x.to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + rows * 8
