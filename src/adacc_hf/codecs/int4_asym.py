"""``int4_asym``: per-row asymmetric INT4 for softmax / attention-score tensors."""

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
        finite = torch.isfinite(xf)
        mx = torch.where(finite, xf, -torch.inf).amax(dim=1)
        mn = torch.where(finite, xf, torch.inf).amin(dim=1)
        any_finite = finite.any(dim=1)
        mx, mn = torch.where(any_finite, mx, 0.0), torch.where(any_finite, mn, 0.0)
        flag = ~finite.all(dim=1)
        offset = (mx + mn) / 2
        scale = (mx - mn) / divisor(flag, 16.0, 2 * 6.0)
        xs = torch.where(finite, xf, offset.unsqueeze(1))
        q = quantize_sym(xs - offset.unsqueeze(1), scale.unsqueeze(1))
        q = torch.where(finite, q, int4_markers(xf))
        tensors = {
            "q": pack_int4(q),
            "scale": flag_scale(scale, flag).contiguous(),
            "offset": offset.contiguous(),
        }
        return tensors, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        rows, channels = rows_channels(enc.shape)
        t = enc.tensors
        q = unpack_int4(t["q"], rows * channels).reshape(rows, channels)
        s = t["scale"].unsqueeze(1)
        x = q.to(torch.float32) * s.abs() + t["offset"].unsqueeze(1)
        return int4_unmark(x, q, torch.signbit(s)).to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return int4_nbytes(rows * channels) + rows * 8
