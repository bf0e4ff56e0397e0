"""``int4_naive`` kernels: symmetric INT4 per row (``group_size=0``) or per group.

Encode: one fused pass (:func:`adacc_kernels.int4._seg_encode_kernel`): each program loads a
[rows, group] tile once, takes ``absmax / 7``, quantises and writes packed bytes and scales.
Odd segments (odd ``group_size``, or odd rows with ``group_size=0``) put bytes across segment
boundaries: a statistics pass, then the flat quantiser (two reads). Decode: one pass.
"""

from __future__ import annotations

import torch

from ._common import check_rows_input, group_layout
from ._triton import check_launchable
from .int4 import SCALE_ROW, SCALE_SEGMENT, encode_segments
from .int4_decode import launch_dequant


def encode(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q uint8 [ceil(R * Cp / 2)], scale float32 [R, Cp // group])."""
    _, channels = check_rows_input(x)
    check_launchable(x.device)
    group, padded = group_layout(channels, group_size)
    q, scale, _ = encode_segments(x, group, asym=False, cp=padded)
    return q, scale


def decode(
    q: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
    channels: int,
    group_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode`: [rows, channels] of ``dtype`` (into ``out`` when given)."""
    check_launchable(q.device)
    group, padded = group_layout(channels, group_size)
    if padded // group > 1:
        return launch_dequant(
            q, scale, rows, channels, dtype, mode=SCALE_SEGMENT, cp=padded, seg=group, out=out
        )
    return launch_dequant(q, scale, rows, channels, dtype, mode=SCALE_ROW, cp=padded, out=out)
