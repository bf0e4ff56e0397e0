"""CUDA's caching allocator: expandable segments from the start, and what it reserves.

A CUDA run runs out of memory when the allocator's *reserved* bytes do not fit, not its allocated
ones. With the default allocator a training step reserves well above what it allocates (H200,
SmolLM2's config bf16 at 4 x 2048: 7-14 % over the budget its allocated bytes landed on;
`benchmarks/results/first-*.json`). Expandable segments map physical pages into one growing
virtual range per stream, so memory freed by one size serves a later request of another. (The
first check's "expandable" runs switched the setting late in a process whose cache already held
default segments; they measured nothing of it. Each reserved figure is now measured in a process
of its own: ``gpu_suite.py --part budget``.)

`at_import` (``import adacc_hf``) turns them on before CUDA starts, where the user has not
configured the allocator (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` unset) nor opted out
(``ADACC_CUDA_ALLOCATOR=default``). `use_expandable_segments` (a session starting) applies the
session's option: where CUDA already runs with other segments, it empties the allocator's cache
first (segments made before a switch keep their kind) and logs one line; the option
``expandable_segments=False`` switches them off again. `reserved_nbytes` reads the allocator's
host-side counter (no device sync).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = [
    "ENV_VAR",
    "allocator_configured",
    "at_import",
    "expandable_action",
    "expandable_now",
    "reserved_nbytes",
    "use_expandable_segments",
]

logger = logging.getLogger("adacc_hf")

#: ``default`` leaves CUDA's allocator as torch configures it.
ENV_VAR = "ADACC_CUDA_ALLOCATOR"
_TORCH_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_on = False  # whether this library turned expandable segments on (and they are on)
_done = False  # a session applied its option (once per process)


def allocator_configured() -> str | None:
    """The user's own allocator setting (torch's environment variables), if any."""
    for var in _TORCH_VARS:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def _opted_out() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() == "default"


def _set(setting: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def _switch(on: bool) -> bool:
    global _on
    try:
        _set(f"expandable_segments:{on}")
    except (RuntimeError, AttributeError) as e:  # a platform without them (ROCm, old drivers)
        logger.info("adacc: CUDA expandable segments unavailable (%s)", e)
        return False
    _on = on
    return True


def expandable_action(
    wanted: bool, *, built: bool, started: bool, configured: bool, opted_out: bool, on: bool
) -> str:
    """What to do with the allocator: ``"on"``, ``"on-after-emptying"``, ``"off-after-emptying"``
    or ``"leave"``.

    Args:
        wanted: the session's option (True at import).
        built: torch was built with CUDA.
        started: CUDA is initialised in this process (its cache may hold segments).
        configured: the user set torch's allocator variables.
        opted_out: ``ADACC_CUDA_ALLOCATOR=default``.
        on: this library already turned expandable segments on.
    """
    if not built or configured or opted_out:
        return "leave"
    if wanted == on:
        return "leave"
    if not wanted:
        return "off-after-emptying"
    return "on-after-emptying" if started else "on"


def at_import() -> None:
    """Turn on expandable segments as ``import adacc_hf`` runs, where CUDA has not started and the
    user set nothing (no device is touched: the setting is read when segments are made)."""
    if torch.cuda.is_initialized():
        return  # a session switches, emptying the cache first
    act = expandable_action(
        True,
        built=torch.backends.cuda.is_built(),
        started=False,
        configured=allocator_configured() is not None,
        opted_out=_opted_out(),
        on=_on,
    )
    if act == "on":
        _switch(True)


def use_expandable_segments(enabled: bool = True) -> bool:
    """Apply a session's option (once per process): expandable segments on unless the user
    configured the allocator, asked for the default (``ADACC_CUDA_ALLOCATOR=default``) or `enabled`
    is False. Where CUDA already runs, the allocator's cache is emptied before the switch (segments
    keep the kind they were made with). Returns whether this call switched anything."""
    global _done
    if _done or not torch.cuda.is_available():
        return False
    _done = True
    own = allocator_configured()
    act = expandable_action(
        enabled,
        built=True,
        started=torch.cuda.is_initialized(),
        configured=own is not None,
        opted_out=_opted_out(),
        on=_on,
    )
    if own is not None:
        logger.info("adacc: CUDA allocator left as configured (%s)", own)
    if act == "leave":
        return False
    if act != "on":
        torch.cuda.empty_cache()
    if not _switch(act != "off-after-emptying"):
        return False
    if act == "off-after-emptying":
        logger.info("adacc: CUDA expandable segments off (expandable_segments=False)")
    else:
        logger.info(
            "adacc: CUDA allocator uses expandable segments%s (reserved memory stays close to what "
            "is allocated); %s=default keeps torch's default",
            " from here (CUDA had started: its cache emptied)" if act != "on" else "",
            ENV_VAR,
        )
    return True


def expandable_now() -> bool:
    """Whether CUDA's allocator makes expandable segments now (this library's switch, or the
    user's own ``expandable_segments:True``)."""
    own = (allocator_configured() or "").replace(" ", "").lower()
    return _on or "expandable_segments:true" in own


def reserved_nbytes(device: torch.device) -> int | None:
    """Bytes CUDA's caching allocator holds on `device` now (None off CUDA). A host counter: no
    device sync. The allocator keeps what it reserved until ``empty_cache``, so read after a step
    it is that step's highest reserved, without resetting anyone's peak statistics."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device)
