"""``int4_outlier``: outlier-separated group INT4 for Linear / LayerNorm inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from adacc_kernels.selection import outlier_capacity, pick_outliers, slot_dtype

from .base import (
    Codec,
    CodecError,
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


def channel_zscores(x: torch.Tensor) -> torch.Tensor:
    """float32 [C] z-scores of the per-channel absolute sums of float32 [rows, C] ``x``.

    ``s_c = sum_rows |x[:, c]|`` over finite elements, ``z_c = (s_c - mean(s)) / std(s)``
    (population std); ``-inf`` everywhere when std == 0 (no outliers). No host sync.
    """
    s = x.abs().nan_to_num_(0.0, 0.0, 0.0).sum(dim=0)
    std, mean = torch.std_mean(s, correction=0)
    ok = std > 0
    z = (s - mean) / torch.where(ok, std, 1.0)
    return torch.where(ok, z, -torch.inf)


def channel_slots(idx: torch.Tensor, channels: int) -> torch.Tensor:
    """[C] in ``slot_dtype(idx.numel())``: the slot of each outlier channel in ``idx``, -1 for
    regular channels."""
    slots = torch.full((channels + 1,), -1, dtype=torch.int64, device=idx.device)
    target = torch.where(idx >= 0, idx.long(), channels)
    slots.scatter_(0, target, torch.arange(idx.numel(), device=idx.device))
    return slots[:channels].to(slot_dtype(idx.numel()))  # a storage of exactly C entries


def _scatter_plan(
    idx: torch.Tensor, values: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target channels, source columns) that put the exact outlier values into ``x`` with one
    fixed-size ``index_copy_``: unused slots repeat the last used slot's write (or rewrite
    channel 0 with its own value when no slot is used), so duplicates write equal values."""
    k = idx.numel()
    used = idx >= 0
    last = (used.sum() - 1).clamp(min=0)
    j = torch.where(used, torch.arange(k, device=idx.device), last)
    target = idx.index_select(0, j).clamp(min=0).long()
    src = values.index_select(1, j)
    src = torch.where(used.any(), src, x[:, :1].expand_as(src))
    return target, src


def select_outlier_channels(
    x: torch.Tensor, zscore_threshold: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int32 [capacity], count) for float32 [rows, C] ``x`` (see
    ``adacc_kernels.selection.pick_outliers``).

    The float32 sums depend on reduction order, so this selection is a decision taken once;
    the quantisation that follows is exactly specified given these indices.
    """
    return pick_outliers(channel_zscores(x), zscore_threshold, capacity)


@register
class Int4OutlierCodec(Codec):
    """Outlier channels kept exactly, the rest symmetric INT4 in groups along the last dim.

    The outlier buffer has a fixed capacity, ``ceil(C * max_outlier_fraction)`` channels (at
    least 1; none when C < 2), so the payload size never depends on the data and encoding never
    waits for the device. Payload: ``outlier_idx`` int32 [K] (ascending, unused slots -1 at the
    end), ``outlier_values`` [rows, K] in the original dtype (0 in unused slots),
    ``outlier_slot`` [C] (empty when K is 0): each channel's slot, -1 for the others, in the
    narrowest integer dtype that holds K (``slot_dtype``: int8 up to 128 slots, then int16), so
    decoding needs no search; then, with those channels zeroed, ``q`` packed nibbles of the
    [rows, Cp] codes (Cp = channels zero-padded to a multiple of ``group_size``) and ``scale``
    float32 [rows, Cp // group_size] with ``scale = absmax / 7``. ``meta["outlier_count"]``: a
    0-dim int32 device tensor, the number of channels above the threshold (more than K means
    the K with the largest z were kept; equal z at the cut: the lower channels).
    """

    name = "int4_outlier"
    lossless = False

    def __init__(
        self,
        zscore_threshold: float = 3.0,
        group_size: int = 64,
        max_outlier_fraction: float = 1 / 32,
    ) -> None:
        t = zscore_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise CodecError(f"{self.name}: zscore_threshold must be a finite float > 0, got {t!r}")
        f = max_outlier_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise CodecError(f"{self.name}: max_outlier_fraction must be in (0, 1], got {f!r}")
        self.zscore_threshold = float(t)
        self.group_size = check_int_param(self.name, "group_size", group_size, 1)
        self.max_outlier_fraction = float(f)

    def params(self) -> dict[str, Any]:
        return {
            "zscore_threshold": self.zscore_threshold,
            "group_size": self.group_size,
            "max_outlier_fraction": self.max_outlier_fraction,
        }

    def capacity(self, channels: int) -> int:
        return outlier_capacity(channels, self.max_outlier_fraction)

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        rows, channels = rows_channels(x.shape)
        xf = as_rows_f32(x)
        idx, count = select_outlier_channels(xf, self.zscore_threshold, self.capacity(channels))
        values = x.reshape(rows, channels).index_select(1, idx.clamp(min=0).long())
        values.masked_fill_(idx < 0, 0)
        slot = channel_slots(idx, channels if idx.numel() else 0)
        if idx.numel():
            xf = xf.masked_fill(slot >= 0, 0.0)
        q, scale = quantize_groups(xf, self.group_size)
        tensors = {
            "q": q,
            "scale": scale,
            "outlier_values": values.contiguous(),
            "outlier_idx": idx,
            "outlier_slot": slot,
        }
        return tensors, {"outlier_count": count}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        t = enc.tensors
        _, channels = rows_channels(enc.shape)
        x = dequantize_groups(t["q"], t["scale"], channels, self.group_size).to(enc.dtype)
        idx = t["outlier_idx"]
        if idx.numel():
            x = x.contiguous()
            target, src = _scatter_plan(idx, t["outlier_values"], x)
            x.index_copy_(1, target, src)
        return x

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        k = self.capacity(channels)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        slot_map = channels * slot_dtype(k).itemsize if k else 0
        # outlier values, their int32 channel indices, the slot map, the int32 outlier count
        return (
            groups_nbytes(rows, channels, self.group_size)
            + rows * k * itemsize
            + k * 4
            + slot_map
            + 4
        )
