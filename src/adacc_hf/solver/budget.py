"""Memory budgets: ``20GiB``, ``"512 MiB"``, ``"20GB"``, ``"80%"``, ``"auto"`` or plain bytes.

`parse_budget` turns a spec into bytes; `describe_budget` says how the number was derived.
Device memory is read with ``torch.cuda`` only when the device is CUDA (CUDA is never
initialised for a CPU device); CPU memory comes from ``sysconf`` and ``/proc/meminfo``.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass

import torch

from ..errors import BudgetError
from ..runtime.offload import host_available
from ..units import GiB, fmt_bytes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*|%)\s*$", re.IGNORECASE)
FORMS = (
    "accepted forms: a positive number of bytes (20000000000), a size with a unit "
    "('20GiB', '20 GiB', '512MiB', '20GB' = 20*10^9, '1.5TB'), a share of the device's total "
    "memory ('80%', in (0, 100]), or 'auto' (free device memory now minus a margin of "
    "max(1 GiB, 5% of total))"
)


@dataclass(frozen=True)
class ResolvedBudget:
    """A budget in bytes and how it was derived."""

    nbytes: int
    how: str


def auto_margin_nbytes(total_nbytes: int) -> int:
    """Head-room that ``"auto"`` leaves free: max(1 GiB, 5 % of the device's total memory)."""
    return max(GiB, total_nbytes // 20)


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        # torch.cuda.is_available() does not create a CUDA context.
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str):  # a profile's device may read "cuda:0 (NVIDIA H100 ...)"
        device = device.split("(")[0].strip()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise BudgetError(f"cannot read device {device!r}: {e}") from None


def device_memory(device: torch.device | str | None = None) -> tuple[int, int]:
    """``(total, free)`` bytes of ``device`` (CUDA: the GPU; anything else: host RAM)."""
    dev = _device(device)
    if dev.type == "cuda":
        try:
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            total = int(torch.cuda.get_device_properties(index).total_memory)
            free = int(torch.cuda.mem_get_info(index)[0])
        except (AssertionError, RuntimeError) as e:
            raise BudgetError(
                f"cannot read the memory of {dev} here ({e}); give the budget as a size "
                "('20GiB') instead of a share or 'auto'"
            ) from None
        return total, free
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(total), host_available(int(total))


def resolve_budget(
    budget: int | float | str,
    device: torch.device | str | None = None,
    resident_nbytes: int = 0,
) -> ResolvedBudget:
    """Bytes of ``budget`` plus a sentence on how they were derived (see module docstring).

    ``resident_nbytes``: bytes the plan counts that are already on the device (parameters,
    gradients, optimizer states): ``auto`` adds them back to the free memory."""
    if isinstance(budget, bool) or budget is None:
        raise BudgetError(f"bad memory budget {budget!r}; {FORMS}")
    if isinstance(budget, numbers.Integral):
        return _positive(int(budget), budget, f"{int(budget)} bytes")
    if isinstance(budget, numbers.Real):
        budget = float(budget)
        if not math.isfinite(budget) or budget < 1:
            hint = " (use a string like '80%' for a share of memory)" if 0 < budget < 1 else ""
            raise BudgetError(f"bad memory budget {budget!r}{hint}; {FORMS}")
        return _positive(int(budget), budget, f"{int(budget)} bytes")
    if not isinstance(budget, str):
        raise BudgetError(f"bad memory budget {budget!r} ({type(budget).__name__}); {FORMS}")
    spec = budget.strip()
    if spec.lower() == "auto":
        dev = _device(device)
        total, free = device_memory(dev)
        margin = auto_margin_nbytes(total)
        have = free + max(0, int(resident_nbytes))
        how = (
            f"auto: {fmt_bytes(free)} free on {dev} now + {fmt_bytes(resident_nbytes)} the model "
            f"already holds, minus a margin of {fmt_bytes(margin)} (max(1 GiB, 5% of the "
            f"{fmt_bytes(total)} total))"
        )
        if have - margin <= 0:
            raise BudgetError(
                f"{how} leaves nothing: free memory on {dev} or give an explicit budget; {FORMS}"
            )
        return ResolvedBudget(have - margin, f"{how} = {fmt_bytes(have - margin)}")
    m = _SIZE.match(spec)
    if m is None or m.group(3).lower() not in {*_UNITS, "%"}:
        raise BudgetError(f"bad memory budget {budget!r}; {FORMS}")
    number = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    if not math.isfinite(number) or not math.isfinite(number * _UNITS.get(m.group(3).lower(), 1)):
        raise BudgetError(f"bad memory budget {budget!r}: the number is out of range; {FORMS}")
    unit = m.group(3).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise BudgetError(f"bad memory budget {budget!r}: a share must be in (0, 100]; {FORMS}")
        dev = _device(device)
        total, _ = device_memory(dev)
        nbytes = int(total * number / 100)
        return _positive(nbytes, budget, f"{number:g}% of {fmt_bytes(total)} total on {dev}")
    nbytes = int(number * _UNITS[unit])
    return _positive(nbytes, budget, f"{spec} = {nbytes} bytes")


def _positive(nbytes: int, spec: object, how: str) -> ResolvedBudget:
    if nbytes <= 0:
        raise BudgetError(f"bad memory budget {spec!r}: it must be positive; {FORMS}")
    return ResolvedBudget(nbytes, f"{how} ({fmt_bytes(nbytes)})")


def parse_budget(
    budget: int | float | str,
    device: torch.device | str | None = None,
    resident_nbytes: int = 0,
) -> int:
    """A memory budget in bytes.

    Sizes are exact; ``%`` and ``auto`` read the device's memory now (host RAM for anything but
    CUDA).

    Args:
        budget: bytes (int), ``"20GiB"`` / ``"20 GiB"`` / ``"512MiB"`` (powers of 2), ``"20GB"``
            / ``"1.5TB"`` (powers of 10), ``"80%"`` of ``device``'s total memory, or ``"auto"``:
            the device's free memory now minus a margin of max(1 GiB, 5 % of total).
        device: the device ``%`` and ``auto`` refer to (default: the current CUDA device if CUDA
            is available, else the host); only read for those.
        resident_nbytes: bytes the plan counts already on the device, added back for ``auto``.

    Returns:
        The budget in bytes (positive).

    Raises:
        BudgetError: anything else, a budget that is not positive, ``auto`` leaving nothing, or
            a device whose memory cannot be read.
    """
    return resolve_budget(budget, device, resident_nbytes).nbytes


def describe_budget(budget: int | float | str, device: torch.device | str | None = None) -> str:
    """How `parse_budget` derives its bytes from ``budget`` (device, total, free, margin)."""
    return resolve_budget(budget, device).how
