"""CUDA's caching allocator: expandable segments by default, and what it reserves.

A CUDA run runs out of memory when the allocator's *reserved* bytes do not fit, not its allocated
ones. A training step reserves well above what it allocates (measured on an H100, SmolLM2-135M
bf16 at 4 x 2048: 1.4-1.7 GiB above a 6-10 GiB allocated peak: `benchmarks/results/first-*.json`).
Expandable segments map physical pages into one growing virtual range per stream, so freed memory
can serve a later request of another size; measured in the same process they changed that gap by
under 1 %, so they are not the fix (issue 28 keeps it open). They stay on: they cost nothing
measurable and return memory to the device in pages.

`use_expandable_segments` turns them on when the user has not configured the allocator
(``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` unset); it also works after CUDA started
(segments made from then on are expandable). Opt out with ``ADACC_CUDA_ALLOCATOR=default`` or the
option ``expandable_segments=False`` of `AdaccConfig`. `reserved_nbytes` reads the allocator's
host-side counter (no device sync).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["ENV_VAR", "allocator_configured", "reserved_nbytes", "use_expandable_segments"]

logger = logging.getLogger("adacc_hf")

#: ``default`` leaves CUDA's allocator as torch configures it.
ENV_VAR = "ADACC_CUDA_ALLOCATOR"
_TORCH_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_done = False


def allocator_configured() -> str | None:
    """The user's own allocator setting (torch's environment variables), if any."""
    for var in _TORCH_VARS:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def _set(setting: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def use_expandable_segments(enabled: bool = True) -> bool:
    """Turn on expandable segments for CUDA (once per process) unless the user configured the
    allocator, asked for the default (``ADACC_CUDA_ALLOCATOR=default``) or `enabled` is False.
    Returns whether this call turned them on."""
    global _done
    if _done or not enabled or not torch.cuda.is_available():
        return False
    _done = True
    if os.environ.get(ENV_VAR, "").strip().lower() == "default":
        return False
    own = allocator_configured()
    if own is not None:
        logger.info("adacc: CUDA allocator left as configured (%s)", own)
        return False
    try:
        _set("expandable_segments:True")
    except (RuntimeError, AttributeError) as e:  # a platform without them (ROCm, old drivers)
        logger.info("adacc: CUDA expandable segments unavailable (%s)", e)
        return False
    logger.info(
        "adacc: CUDA allocator uses expandable segments (reserved memory stays close to what is "
        "allocated); %s=default keeps torch's default",
        ENV_VAR,
    )
    return True


def reserved_nbytes(device: torch.device) -> int | None:
    """Bytes CUDA's caching allocator holds on `device` now (None off CUDA). A host counter: no
    device sync. The allocator keeps what it reserved until ``empty_cache``, so read after a step
    it is that step's highest reserved, without resetting anyone's peak statistics."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device)


def allocated_peak_nbytes(device: torch.device) -> int | None:
    """The highest bytes CUDA's allocator handed out since its last peak reset (None off CUDA). A
    host counter: no device sync."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_allocated_peak(device: torch.device) -> None:
    """Start a new peak window of `allocated_peak_nbytes` (nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
