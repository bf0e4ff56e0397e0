"""``int4_asym`` kernels: per-row asymmetric INT4 (softmax / attention scores).

Encode: one fused pass over each row (min and max over the finite elements, ``offset = (max + min) / 2``,
``scale = (max - min) / 16``, quantise ``x - offset``, pack); rows wider than a register tile
are read twice (the second read is cache-hot). Odd channel counts: statistics pass + flat
quantiser. Decode: one pass, ``q * scale + offset`` (no FMA), one cast.
"""

from __future__ import annotations

import torch

from ._common import check_rows_input
from ._triton import check_launchable
from .int4 import SCALE_ROW, encode_segments
from .int4_decode import launch_dequant


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q uint8 [ceil(R * C / 2)], scale float32 [R], offset float32 [R])."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    q, scale, offset = encode_segments(x, channels, asym=True, cp=channels)
    assert offset is not None
    return q, scale.reshape(rows), offset.reshape(rows)


def decode(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    rows: int,
    channels: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_launchable(q.device)
    return launch_dequant(
        q, scale, rows, channels, dtype, mode=SCALE_ROW, cp=channels, offset=offset, out=out
    )
