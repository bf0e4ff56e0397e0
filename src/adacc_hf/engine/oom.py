"""Out of memory: what the device's error says, and the bytes every later plan keeps free.

A step that runs out of memory ran a plan the device could not hold: the budget is above what the
device has (another process, the allocator's rounding and segments), or the plan under-predicted.
Either is a fact about the device, not about one bucket, so the session keeps a *device reserve*
below the budget for every plan, and every bucket is planned again before its next forward.

The reserve after an out-of-memory error, from its message where it says (CUDA's and
`runtime.capacity.DeviceMeter`'s: "tried to allocate X ... of which F (is) free ... U in use"):

* at least what was missing at the failure (X - F) plus one segment's rounding (2 MiB);
* at least a tenth of the activation share (budget - static memory), and at least twice the
  reserve before, so repeated errors reach full recomputation in a few steps, never dozens;
* where the device says what it holds (U + F), enough that the plan fits under that.

The planned budget never goes below full recomputation's peak (`solver.planned_budget`): once
the reserve covers the whole activation share, every plan is full recomputation, and an error
there is the run's own (`at_floor`): the caller re-raises it with what to change.
"""

from __future__ import annotations

import gc
import logging
import re

import torch

from .guard import MARGIN
from .plans import AdaccEvent

__all__ = ["first_line", "grown_reserve", "oom_event", "parse_oom", "release"]

logger = logging.getLogger("adacc_hf")

_UNITS = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"


def _size(pattern: str, message: str) -> int | None:
    m = re.search(pattern.replace("SIZE", _SIZE), message, re.IGNORECASE)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else None


def parse_oom(message: str) -> dict[str, int | None]:
    """The sizes an out-of-memory message gives: ``tried`` (the failed allocation), ``free`` and
    ``in_use`` (by this process), each None where the message does not say."""
    return {
        "tried": _size(r"Tried to allocate SIZE", message),
        "free": _size(r"of which SIZE (?:is )?free", message),
        "in_use": _size(r"(?:this process has|;) SIZE (?:memory )?in use", message),
    }


def grown_reserve(reserve: int, budget: int, static: int, message: str) -> int:
    """The device reserve after an out-of-memory error with `message`, from `reserve` (see the
    module docstring)."""
    sizes = parse_oom(message)
    tried, free, in_use = sizes["tried"], sizes["free"], sizes["in_use"]
    missing = max(0, tried - (free or 0)) if tried is not None else 0
    step = max(missing + MARGIN, max(0, budget - static) // 10, MARGIN)
    new = max(2 * reserve, reserve + step)
    if in_use is not None and free is not None:
        new = max(new, budget - (in_use + free) + step)  # plan under what the device holds
    return new


def at_floor(reserve: int, budget: int, static: int) -> bool:
    """Whether a reserve leaves no activation share to plan with: only full recomputation."""
    return reserve >= max(0, budget - static)


def first_line(message: str) -> str:
    """An out-of-memory message's first line, short enough for a log line or a note."""
    return (message.strip().splitlines() or ["out of memory"])[0][:160]


def release(device: torch.device) -> None:
    """After an out-of-memory error has been left: collect what its frames held and return the
    allocator's cached blocks, so the next attempt starts from what is really alive."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def oom_event(step: int, before: int, after: int, message: str) -> AdaccEvent:
    """The logged event of a reserve grown from `before` to `after` bytes."""
    msg = (
        f"step {step}: out of memory ({first_line(message)}); every bucket re-planned with "
        f"{after / 2**20:.1f} MiB kept free below the budget (was {before / 2**20:.1f} MiB)"
    )
    logger.warning("adacc: %s", msg)
    return AdaccEvent(step, "oom", None, msg, {"adacc/oom_reserve_mib": after / 2**20})
