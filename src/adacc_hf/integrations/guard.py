"""The budget guard: what CUDA's allocator really reserved, checked against the budget after steps.

The step model predicts allocated bytes (exactly on CPU; within megabytes on an H100), but CUDA
runs out when the caching allocator's *reserved* bytes do not fit, and those also hold rounding,
segments and fragmentation that no profile of one block sees. After a step, the allocator's
reserved bytes (a host counter, `runtime.allocator.reserved_nbytes`: no device sync, no reset of
anyone's peak statistics) are that step's highest. When they exceed the budget, the bucket that
just ran is planned again with the overshoot (and a margin) kept free, the allocator's cache is
emptied so the new plan's smaller footprint can show, and an event is logged. Off CUDA (exact
accounting) the guard does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..runtime.allocator import reserved_nbytes
from .plans import AdaccEvent, Plan

__all__ = ["MARGIN", "ReservedGuard"]

logger = logging.getLogger("adacc_hf")

#: Kept free beyond the measured overshoot: one large-pool segment's rounding (2 MiB).
MARGIN = 2 << 20


class ReservedGuard:
    """Re-plans a bucket whose step left the allocator reserving more than the budget."""

    def __init__(self, read: Callable[[torch.device], int | None] = reserved_nbytes) -> None:
        self.read = read
        self.replans = 0

    def check(
        self,
        plan: Plan | None,
        budget: int | None,
        device: torch.device,
        step: int,
        agree: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
    ) -> AdaccEvent | None:
        """After step `step` ran `plan`: mark it for re-planning if the allocator reserved more
        than `budget` (returns the event, or None). `agree` (a coordinator's: the largest of
        every rank's) makes every rank take the same decision, so all re-plan in lockstep."""
        if plan is None or budget is None or plan.key is None:
            return None  # a user's fixed policy, or no budget in bytes yet
        reserved = self.read(device)
        if agree is not None:
            reserved = agree((-1 if reserved is None else reserved,))[0]
        if reserved is None or reserved < 0 or reserved <= budget:
            return None
        over = reserved - budget + MARGIN
        plan.reserve_nbytes += over
        plan.stale = True
        self.replans += 1
        if device.type == "cuda":
            torch.cuda.empty_cache()  # cached blocks of the old plan would keep reserved high
        msg = (
            f"step {step}: CUDA reserved {reserved / 2**20:.1f} MiB, "
            f"{(reserved - budget) / 2**20:.1f} MiB over the budget; bucket re-planned with "
            f"{plan.reserve_nbytes / 2**20:.1f} MiB kept free"
        )
        logger.warning("adacc: %s", msg)
        return AdaccEvent(
            step, "guard", None, msg, {"adacc/reserved_over_budget_mib": over / 2**20}
        )
