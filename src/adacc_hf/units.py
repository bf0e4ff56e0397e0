"""Byte units and how sizes are printed, for every layer (the policy's display and the solver's
messages alike)."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20


def fmt_bytes(n: float) -> str:
    """``12.34 GiB`` / ``56.78 MiB`` / ``0.41 MiB`` / ``910 B`` (MiB from 1 KiB: sizes that sit
    side by side on a line read in one unit)."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= 1024:
        return f"{n / MiB:.2f} MiB"
    return f"{int(n)} B"
