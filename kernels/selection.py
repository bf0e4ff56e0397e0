"""The step of ``int4_outlier``'s channel selection that kernels and reference share (torch only).

Both paths compute per-channel z-scores (the kernel in Triton, the reference in torch; they sum
columns in different orders), then fill the fixed-size outlier buffer from them here, so given
equal z-scores the selections are equal. Nothing here waits for the device.
"""

from __future__ import annotations

import math

import torch


def outlier_capacity(channels: int, max_outlier_fraction: float) -> int:
    """Slots of the fixed-size outlier buffer for ``channels`` channels (0 when C < 2)."""
    if channels < 2:
        return 0
    return min(channels, max(1, math.ceil(channels * max_outlier_fraction)))


def pick_outliers(
    z: torch.Tensor, zscore_threshold: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int32 [capacity], count int32 0-dim) from float32 channel z-scores ``z``.

    Outliers are the channels with ``z > zscore_threshold``; ``count`` says how many there are.
    The buffer keeps the ``capacity`` largest of them in ascending channel order; unused slots
    hold -1, at the end.
    """
    channels = z.numel()
    hot = z > zscore_threshold
    count = hot.sum(dtype=torch.int32)
    if capacity == 0:
        return torch.empty(0, dtype=torch.int32, device=z.device), count
    vals, top = torch.topk(torch.where(hot, z, -torch.inf), capacity)
    idx = torch.where(vals > zscore_threshold, top, channels).sort().values
    return torch.where(idx < channels, idx, -1).to(torch.int32), count
