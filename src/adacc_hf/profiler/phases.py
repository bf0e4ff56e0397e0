"""Where planning time goes: wall ms per phase (op timing, codecs, calibration, memory, head,
gradient errors, action tables, solving), each phase its own time only (a phase inside another
counts for itself, not for the outer one).

`recording()` collects the phases of whatever runs inside it; `phase(name)` anywhere below adds
to the innermost recording, and costs nothing when none is active (a bare `profile_model`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["PHASES", "format_phases", "phase", "recording"]

#: Every phase, in the order a plan runs them.
PHASES = (
    "ops",  # each op's forward timed one at a time, and the block whole
    "codecs",  # encode / decode / error of each candidate codec on the op's output
    "calibration",  # the block's forward + backward under the four action tables
    "head",  # the ways of running the LM head and loss
    "memory",  # the step's memory timeline and the plain-block runs
    "grad_errors",  # the block's gradient error with each lossy codec
    "solve",  # the MILP
    "action_tables",  # the solved policy's tables measured on the profiled block
    "policy_error",  # the solved policy's gradient error on the profiled block
    "other",  # tracing, padding, bookkeeping
)

_active: ContextVar[_Recorder | None] = ContextVar("adacc_phases", default=None)


class _Recorder:
    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.stack: list[list] = []  # [name, start, time spent in nested phases]


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """A dict that gets each phase's ms (``other``: the rest of the time inside this block).
    Inside another recording, the outer one's dict (phases so far), which it completes."""
    outer = _active.get()
    if outer is not None:
        yield outer.ms
        return
    rec = _Recorder()
    token = _active.set(rec)
    t0 = time.perf_counter()
    try:
        yield rec.ms
    finally:
        _active.reset(token)
        total = (time.perf_counter() - t0) * 1e3
        rec.ms["other"] = rec.ms.get("other", 0.0) + max(0.0, total - sum(rec.ms.values()))


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the time inside as `name`'s (less the nested phases' own)."""
    rec = _active.get()
    if rec is None:
        yield
        return
    frame = [name, time.perf_counter(), 0.0]
    rec.stack.append(frame)
    try:
        yield
    finally:
        rec.stack.pop()
        spent = (time.perf_counter() - frame[1]) * 1e3
        rec.ms[name] = rec.ms.get(name, 0.0) + spent - frame[2]
        if rec.stack:
            rec.stack[-1][2] += spent


def format_phases(ms: dict[str, float]) -> str:
    """``"57.1 s: calibration 20.3 s, ops 12.0 s, ..."``, largest first, zeros left out."""
    total = sum(ms.values())
    parts = [f"{k} {v / 1e3:.1f} s" for k, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v]
    return f"{total / 1e3:.1f} s: " + ", ".join(parts)
