"""``int4_outlier``'s channel selection rule, in torch (the reference), and the buffer sizes
kernels and reference share.

The reference computes z-scores in torch and fills the fixed-size outlier buffer here; the
kernel path does both in one Triton launch (:mod:`adacc_kernels.int4_select`) following the same
rule, so given equal z-scores the selections are equal (they sum columns in different orders,
so z-scores may differ in the last bits). Nothing here waits for the device.
"""

from __future__ import annotations

import math

import torch


def outlier_capacity(channels: int, max_outlier_fraction: float) -> int:
    """Slots of the fixed-size outlier buffer for ``channels`` channels (0 when C < 2)."""
    if channels < 2:
        return 0
    return min(channels, max(1, math.ceil(channels * max_outlier_fraction)))


def slot_dtype(capacity: int) -> torch.dtype:
    """The narrowest signed integer dtype of the channel -> slot map (slots -1 .. capacity - 1)."""
    if capacity <= 128:
        return torch.int8
    return torch.int16 if capacity <= 32768 else torch.int32


def pick_outliers(
    z: torch.Tensor, zscore_threshold: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int32 [capacity], count int32 0-dim) from float32 channel z-scores ``z``.

    Outliers are the channels with ``z > zscore_threshold``; ``count`` says how many there are.
    The buffer keeps the ``capacity`` largest of them (equal z-scores at the cut: the lower
    channel first) in ascending channel order; unused slots hold -1, at the end.
    """
    channels = z.numel()
    hot = z > zscore_threshold
    count = hot.sum(dtype=torch.int32)
    if capacity == 0:
        return torch.empty(0, dtype=torch.int32, device=z.device), count
    key = torch.where(hot, z, -torch.inf)
    vals, top = torch.sort(key, descending=True, stable=True)  # ties keep ascending channels
    vals, top = vals[:capacity], top[:capacity]
    idx = torch.where(vals > zscore_threshold, top, channels).sort().values
    return torch.where(idx < channels, idx, -1).to(torch.int32), count
