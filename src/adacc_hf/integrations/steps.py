"""What a session does between optimizer steps: the reserved-memory guard and the rectifier.

`StepHooks` is `AdaccSession`'s per-step half (a mixin: it reads the session's plans, config and
handle). Before a step on the tracking schedule (1, 2, 4, ... steps apart) the rectifier arms an
`evolution.OutlierTracker`; after it, the measured codec statistics update the profile, the
policy is solved again and switched to when it is clearly better or the current one no longer
holds (budget, codec error, gradient error). After every step the guard compares what CUDA's
allocator reserved with the budget (`guard`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..evolution import (
    OutlierTracker,
    TrackingSchedule,
    apply_stats,
    should_switch,
    tracking_room,
)
from ..policy import Policy
from ..policy.display import describe, metrics
from ..runtime import AdaccHandle
from ..runtime.capacity import oom_count
from ..schema import Profile
from .guard import DerivedCheck, ReservedGuard
from .oom import at_floor, grown_reserve, oom_event
from .plans import AdaccEvent, Plan
from .retry import StepRetry
from .solving import SessionSolving

logger = logging.getLogger("adacc_hf")

__all__ = ["StepHooks"]


class StepHooks(SessionSolving):
    """The per-step part of `AdaccSession` (see the module docstring), over its profiling and
    solving parts; the session sets these attributes and patches the model (`apply`)."""

    current: Plan | None
    fixed: bool
    handle: AdaccHandle | None
    schedule: TrackingSchedule
    events: list[AdaccEvent]
    budget_nbytes: int | None
    guard: ReservedGuard
    derived_check: DerivedCheck
    step: int
    _tracker: OutlierTracker | None
    _ooms_seen: int
    _retry: StepRetry | None = None

    def apply(self, policy: Policy) -> None: ...

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def policy(self) -> Policy | None:
        return self.current.policy if self.current is not None else None

    @property
    def profile(self) -> Profile | None:
        return self.current.profile if self.current is not None else None

    @property
    def active(self) -> bool:
        return self.handle is not None and self.handle.active

    def on_step_begin(self, step: int) -> None:
        """Call before the forward of optimizer step `step` (1-based)."""
        self.step = step
        if (
            self.config.adaptive
            and self.active
            and self.profile is not None
            and self.schedule.is_tracking_step(step)
        ):
            room: tuple[int | None, int | None] = (None, None)  # None: no budget in bytes yet
            if self.budget_nbytes is not None and self.policy is not None:
                acc = self.config.gradient_accumulation_steps
                room = tracking_room(
                    self.profile, self.policy, self._static(), acc, self.budget_nbytes
                )
            self._tracker = OutlierTracker(self.profile, room=room[0], forward_room=room[1])
            self.handle.set_tracker(self._tracker)

    def on_step_end(self, step: int) -> AdaccEvent | None:
        """Call after optimizer step `step`: the reserved-memory guard; on tracking steps,
        re-solve and maybe switch."""
        for plan in self.derived_check.step_ended(self.device, self.coordinator.agree):
            self.measure_in_full(plan)
        if self.active and not self.fixed:
            guarded = self.guard.check(
                self.current, self.budget_nbytes, self.device, step, self.coordinator.agree
            )
            if guarded is not None:
                self.events.append(guarded)
        tracker, self._tracker = self._tracker, None
        if tracker is None or not self.active:
            return None
        self.handle.set_tracker(None)
        stats = self.coordinator.merge(tracker.stats)
        new_profile, changes = apply_stats(self.profile, stats)
        for plan in self.plans.values():  # the other buckets re-solve when next used
            if plan is not self.current and plan.profile is not None and changes:
                plan.profile, _ = apply_stats(plan.profile, stats)
                plan.stale = True
        self.current.profile = new_profile

        def decide() -> Policy:
            new, c = self.solve(new_profile, self.current.reserve_nbytes), self.config
            switch = should_switch(
                new_profile, self.policy, new, self._static(), budget_nbytes=self.budget_nbytes or 0,
                max_rel_error=c.max_codec_error, accumulation=c.gradient_accumulation_steps,
                max_grad_error=c.max_grad_error,
            )  # fmt: skip
            return new if switch else self.policy

        new_policy = self.coordinator.share(decide)
        changed = new_policy.fingerprint() != self.policy.fingerprint()
        self.schedule.advance(step, changed)
        if not changed:
            event = AdaccEvent(step, "track", None, f"{len(changes)} codec statistics moved")
            self.events.append(event)
            return event
        self.apply(new_policy)
        msg = f"switched policy at step {step}: {describe(new_policy)}"
        if changes:
            msg += "; " + "; ".join(changes[:5])
        logger.info("adacc %s", msg)
        event = AdaccEvent(step, "switch", new_policy, msg, metrics(new_policy))
        self.events.append(event)
        return event

    def out_of_memory(self, message: str = "") -> bool:
        """After an out-of-memory error (its `message`): grow the device reserve every plan keeps
        free below the budget (`oom`) and mark every bucket for re-planning before its next
        forward. False where the reserve already left only full recomputation: the error is the
        run's own, and the caller should raise it."""
        self._ooms_seen = oom_count(self.device)
        if self.fixed:
            return False
        budget, static = self._budget(), self._static().total
        before = self.oom_reserve_nbytes
        if at_floor(before, budget, static):
            return False
        self.oom_reserve_nbytes = grown_reserve(before, budget, static, message)
        for plan in self.plans.values():
            plan.stale = True
        self.events.append(oom_event(self.step, before, self.oom_reserve_nbytes, message))
        return True

    def run_step(
        self, run: Callable[[Any], Any], batches: Iterable[Any] | Mapping[str, Any]
    ) -> list[Any]:
        """Custom loops: run one optimizer step's micro-batches, surviving out of memory.

        ``run(batch)`` runs one micro-batch's forward and backward (``accelerator.backward``
        included); call the optimizer after. A micro-batch that runs out of memory is re-planned
        and the step's micro-batches run again from the first with their own random states, so
        the gradients are those of a run that never failed (`retry`). Under several ranks errors
        pass through (another rank would wait in a collective).

        Args:
            run: the function of one micro-batch; its results are returned in order.
            batches: the step's micro-batches (or one batch).

        Returns:
            ``run``'s result for each micro-batch.
        """
        if isinstance(batches, Mapping):
            batches = [batches]
        if self.coordinator.distributed or self.fixed:
            return [run(b) for b in batches]
        if self._retry is None:
            self._retry = StepRetry(lambda: self, self.model, self.device)
        return self._retry.whole_step(run, batches)

    def check_oom(self) -> None:
        """Before a forward: an out-of-memory error raised since the last check (CUDA's own count,
        or a simulated device's) that nobody reported grows the reserve (a loop or Trainer that
        caught it and goes on: accelerate's ``find_executable_batch_size``, ``auto_find_batch_size``)."""
        if self.coordinator.distributed:
            return  # one rank's error alone would take it out of lockstep with the others
        seen = oom_count(self.device)
        if seen > self._ooms_seen and self.out_of_memory():
            logger.warning(
                "adacc: an out-of-memory error was raised since the last step; re-planned with "
                "%.1f MiB kept free (Trainers, and session.run_step in a custom loop, re-run the step "
                "themselves)",
                self.oom_reserve_nbytes / 2**20,
            )
        self._ooms_seen = seen

    def step_done(self, step: int) -> AdaccEvent | None:
        """For custom loops: call once after each optimizer step."""
        event = self.on_step_end(step)
        self.on_step_begin(step + 1)
        return event

    def restore_schedule(self, state: dict[str, Any]) -> None:
        """Continue a saved tracking schedule (resume)."""
        self.schedule = TrackingSchedule.from_state_dict(state)
