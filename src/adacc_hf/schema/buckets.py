"""Bucket edges of lengths: the one rule both the plans per batch shape (`engine.shapes`)
and the runtime's slot tables (`runtime.slots.call_signature`) round lengths with."""

from __future__ import annotations

import math


def bucket_edge(length: int, max_length: int | None = None) -> int:
    """The smallest bucket edge >= `length`: multiples of 8 up to 64, then four edges per
    doubling (64, 80, 96, 112, 128, 160, ...: at most 25 % apart, every power of two an edge);
    ``max_length`` caps the edges."""
    if length <= 64:
        edge = max(8, math.ceil(length / 8) * 8)
    else:
        octave = 2 ** (math.ceil(length).bit_length() - 1)  # the power of two <= length
        step = octave // 4
        edge = math.ceil(length / step) * step
    return min(edge, max_length) if max_length and max_length >= length else edge
