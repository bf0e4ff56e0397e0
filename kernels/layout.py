"""Payload layout rules shared by the torch references (``adacc_hf.codecs``) and the kernels.

Plain Python (no torch, no triton), so the references can import it without triton installed.
"""

from __future__ import annotations


def group_layout(channels: int, group_size: int) -> tuple[int, int]:
    """(group, padded_channels). ``group_size == 0`` means one group per row (no padding)."""
    group = group_size or channels
    return group, -(-channels // group) * group
