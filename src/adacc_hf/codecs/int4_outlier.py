"""``int4_outlier``: outlier-separated group INT4 for Linear / LayerNorm inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from . import dispatch
from .base import (
    Codec,
    CodecError,
    Encoded,
    as_rows_f32,
    check_int_param,
    dequantize_groups,
    groups_nbytes,
    quantize_groups,
    register,
    rows_channels,
)


def select_outlier_channels(x: torch.Tensor, zscore_threshold: float) -> torch.Tensor:
    """Ascending int32 indices of the outlier channels of float32 [rows, C] ``x``.

    ``s_c = sum_rows |x[:, c]|``, ``z_c = (s_c - mean(s)) / std(s)`` (population std);
    outliers are ``z_c > zscore_threshold``. None when C < 2 or std == 0. The float32 sums
    depend on reduction order, so this selection is a decision taken once (in torch); the
    quantisation that follows is exactly specified given these indices.
    """
    if x.shape[1] < 2:
        return torch.empty(0, dtype=torch.int32, device=x.device)
    s = x.abs().sum(dim=0)
    std, mean = torch.std_mean(s, correction=0)
    if not bool(std > 0):
        return torch.empty(0, dtype=torch.int32, device=x.device)
    z = (s - mean) / std
    return torch.nonzero(z > zscore_threshold).reshape(-1).to(torch.int32)


@register
class Int4OutlierCodec(Codec):
    """Outlier channels kept exactly, the rest symmetric INT4 in groups along the last dim.

    Payload: ``outlier_idx`` int32 [n_out] (ascending), ``outlier_values`` [rows, n_out] in the
    original dtype, then with those channels zeroed: ``q`` packed nibbles of the [rows, Cp]
    codes (Cp = channels zero-padded to a multiple of ``group_size``) and ``scale`` float32
    [rows, Cp // group_size] with ``scale = absmax / 7``. ``meta["n_outliers"]`` = n_out.
    """

    name = "int4_outlier"
    lossless = False

    def __init__(self, zscore_threshold: float = 3.0, group_size: int = 64) -> None:
        t = zscore_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise CodecError(f"{self.name}: zscore_threshold must be a finite float > 0, got {t!r}")
        self.zscore_threshold = float(t)
        self.group_size = check_int_param(self.name, "group_size", group_size, 1)

    def params(self) -> dict[str, Any]:
        return {"zscore_threshold": self.zscore_threshold, "group_size": self.group_size}

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        if dispatch.use_kernel(x):
            return dispatch.encode(self, x)
        rows, channels = rows_channels(x.shape)
        xf = as_rows_f32(x)
        idx = select_outlier_channels(xf, self.zscore_threshold)
        idx_long = idx.long()
        values = x.reshape(rows, channels).index_select(1, idx_long).contiguous()
        if idx.numel():
            xf = xf.index_fill(1, idx_long, 0.0)
        q, scale = quantize_groups(xf, self.group_size)
        tensors = {"q": q, "scale": scale, "outlier_values": values, "outlier_idx": idx}
        return Encoded(self.name, x.shape, x.dtype, tensors, {"n_outliers": int(idx.numel())})

    def decode(self, enc: Encoded) -> torch.Tensor:
        self._check_encoded(enc)
        if dispatch.use_kernel(enc.device):
            return dispatch.decode(self, enc)
        t = enc.tensors
        _, channels = rows_channels(enc.shape)
        x = dequantize_groups(t["q"], t["scale"], channels, self.group_size).to(enc.dtype)
        if t["outlier_idx"].numel():
            x = x.index_copy(1, t["outlier_idx"].long(), t["outlier_values"])
        return x.reshape(enc.shape)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        n = n_outlier_channels
        if not 0 <= n <= (channels if channels >= 2 else 0):
            raise CodecError(f"{self.name}: n_outlier_channels={n} impossible for shape {shape}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return groups_nbytes(rows, channels, self.group_size) + rows * n * itemsize + n * 4
