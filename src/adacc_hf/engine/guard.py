"""The budget guard: what CUDA's allocator really reserved, checked against the budget after steps.

The step model predicts allocated bytes (exactly on CPU; within megabytes on an H100), but CUDA
runs out when the caching allocator's *reserved* bytes do not fit, and those also hold rounding,
segments and fragmentation that no profile of one block sees. After a step, the allocator's
reserved bytes (a host counter, `runtime.allocator.reserved_nbytes`: no device sync, no reset of
anyone's peak statistics) are that step's highest. When they exceed the budget, the bucket that
just ran is planned again with the overshoot (and a margin) kept free, the allocator's cache is
emptied so the new plan's smaller footprint can show, and an event is logged. Buckets planned
later start with the largest reserve a re-plan kept free (the allocator's overshoot is the
device's, not one bucket's: a loop of new lengths would otherwise run each first step over). Off
CUDA (exact accounting) the guard does nothing.

`DerivedCheck` watches the first step of a bucket whose memory was interpolated rather than
measured (`profiler.derive`): the highest bytes allocated over that step (its allocation events,
replayed: no peak statistic of the user's is reset) against the prediction. The interpolation never under-counts on CPU (tests/engine/test_derive.py); where a device
allocates more than predicted, the bucket is profiled in full before its next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.allocator import reserved_nbytes
from ..runtime.peak import AllocationTracker
from .plans import AdaccEvent, Plan

__all__ = ["MARGIN", "DerivedCheck", "ReservedGuard", "peak_of", "peak_window"]

logger = logging.getLogger("adacc_hf")

#: Kept free beyond the measured overshoot: one large-pool segment's rounding (2 MiB).
MARGIN = 2 << 20


class ReservedGuard:
    """Re-plans a bucket whose step left the allocator reserving more than the budget."""

    def __init__(self, read: Callable[[torch.device], int | None] = reserved_nbytes) -> None:
        self.read = read
        self.replans = 0
        # the largest reserve a re-plan kept free: a bucket planned from then on starts with it
        self.learned_nbytes = 0

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
        self.learned_nbytes = max(self.learned_nbytes, plan.reserve_nbytes)
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


def _predicted(plan: Plan) -> int | None:
    pred = plan.policy.metadata.get("predicted")
    return pred.get("peak_nbytes") if isinstance(pred, dict) else None


def peak_window(device: torch.device) -> Any:
    """Start measuring the allocated peak of a step on `device` (CUDA: allocation events replayed,
    `runtime.peak.AllocationTracker`, no statistic reset; elsewhere nothing is measured)."""
    if device.type != "cuda":
        return None
    tracker = AllocationTracker(device)
    start = torch.cuda.memory_allocated(tracker.device)
    tracker.__enter__()
    return tracker, start


def peak_of(window: Any, keep: bool = True) -> int | None:
    """End a `peak_window`: the highest bytes allocated within it (None: nothing measured, or
    `keep` False: abandoned)."""
    if window is None:
        return None
    tracker, start = window
    tracker.__exit__(None, None, None)
    return start + tracker.peak_nbytes if keep else None


class DerivedCheck:
    """The first step of each bucket planned from interpolated memory, against its prediction
    (CUDA: the step's allocation events, `peak_window`; off CUDA nothing is read).

    Args:
        begin: starts a measurement on a device (`peak_window`).
        end: ends one, returning its peak or None (`peak_of`).
    """

    def __init__(
        self,
        begin: Callable[[torch.device], Any] = peak_window,
        end: Callable[..., int | None] = peak_of,
    ) -> None:
        self.begin, self.end = begin, end
        self.watched: list[Plan] = []  # the plans of the step being watched
        self.checked: set[int] = set()  # ids of the plans whose step was checked
        self._window: Any = None

    def step_uses(self, plan: Plan | None, device: torch.device) -> None:
        """Before a training forward runs `plan`: start watching the step if `plan`'s memory is
        interpolated and unchecked, and note every plan the watched step runs."""
        if plan is None or plan.profile is None or plan.key is None:
            return
        if not self.watched:
            if not plan.profile.memory_from or id(plan) in self.checked:
                return
            self._window = self.begin(device)
        if all(p is not plan for p in self.watched):
            self.watched.append(plan)

    def abandon(self) -> None:
        """The session measures something of its own (profiling does not nest in a measured
        step): the watch ends unread, its plans stay unchecked for a later step."""
        if self.watched:
            self.end(self._window, False)
            self.watched, self._window = [], None

    def step_ended(
        self,
        device: torch.device,
        agree: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
    ) -> list[Plan]:
        """After the watched step: the plans whose interpolated memory it disproved (the step's
        peak passed the highest prediction of the plans it ran by more than `MARGIN`). `agree`
        (a coordinator's: the largest of every rank's) makes every rank decide alike; every rank
        watches the same steps (the buckets are agreed on)."""
        watched, self.watched = self.watched, []
        if not watched:
            return []
        self.checked.update(id(p) for p in watched)
        peak = self.end(self._window)
        self._window = None
        predicted = [p for plan in watched if (p := _predicted(plan)) is not None]
        over = peak is not None and bool(predicted) and peak > max(predicted) + MARGIN
        if agree is not None:
            over = bool(agree((int(over),))[0])
        if not over:
            return []
        return [p for p in watched if p.profile is not None and p.profile.memory_from]
