"""What a session does around optimizer steps: the rectifier, and out-of-memory recovery.

`Rectifier`: before a step on the tracking schedule (1, 2, 4, ... steps apart) it arms an
`evolution.OutlierTracker`; after it, the measured codec statistics update the profile, the
policy is solved again and switched to when it is clearly better or the current one no longer
holds (budget, codec error, gradient error).

`OomRecovery`: an out-of-memory error grows the device reserve every plan keeps free below the
budget (`oom`) and marks every bucket for re-planning; `run_step` re-runs a custom loop's step
(`retry`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..evolution import (
    OutlierTracker,
    TrackingSchedule,
    apply_stats,
    should_switch,
    tracking_room,
)
from ..policy import Policy
from ..policy.display import describe, metrics
from ..runtime.capacity import oom_count
from .context import SessionContext
from .oom import at_floor, grown_reserve, oom_event
from .planner import Planner
from .plans import AdaccEvent
from .retry import StepRetry

logger = logging.getLogger("adacc_hf")

__all__ = ["OomRecovery", "Rectifier"]


class Rectifier:
    """Re-measures the codecs on tracking steps and re-solves (see the module docstring).

    Args:
        ctx: the session's shared state.
        planner: the run's plans (the current one is tracked).
    """

    def __init__(self, ctx: SessionContext, planner: Planner) -> None:
        self.ctx, self.planner = ctx, planner
        self.schedule = TrackingSchedule(ctx.config.tracking.max_tracking_interval)
        self.tracker: OutlierTracker | None = None

    def restore(self, state: dict[str, Any]) -> None:
        """Continue a saved tracking schedule (a resumed run).

        Args:
            state: the ``"schedule"`` entry of a saved `AdaccSession.state_dict`.
        """
        self.schedule = TrackingSchedule.from_state_dict(state)

    def arm(self, step: int) -> OutlierTracker | None:
        """Before optimizer step `step`: the tracker its forwards feed, on a tracking step."""
        plan, ctx = self.planner.current, self.ctx
        if not ctx.config.tracking.adaptive or plan is None or plan.profile is None:
            return None
        if not self.schedule.is_tracking_step(step):
            return None
        room: tuple[int | None, int | None] = (None, None)  # None: no budget in bytes yet
        if ctx.budget_nbytes is not None:
            acc = ctx.config.run.gradient_accumulation_steps
            room = tracking_room(
                plan.profile, plan.policy, ctx.static_memory(), acc, ctx.budget_nbytes
            )
        self.tracker = OutlierTracker(plan.profile, room=room[0], forward_room=room[1])
        return self.tracker

    def decide(self, step: int, tracker: OutlierTracker) -> tuple[AdaccEvent, Policy | None]:
        """After tracking step `step`: the event, and the policy to switch to (None: keep)."""
        ctx, planner = self.ctx, self.planner
        current = planner.current
        stats = ctx.coordinator.merge(tracker.stats)
        new_profile, changes = apply_stats(current.profile, stats)
        for plan in planner.plans.values():  # the other buckets re-solve when next used
            if plan is not current and plan.profile is not None and changes:
                plan.profile, _ = apply_stats(plan.profile, stats)
                plan.stale = True
        current.profile = new_profile

        def decide() -> Policy:
            new, c = planner.solver.solve(new_profile, current.reserve_nbytes), ctx.config
            switch = should_switch(
                new_profile, current.policy, new, ctx.static_memory(),
                budget_nbytes=ctx.budget_nbytes or 0, max_rel_error=c.compression.max_codec_error,
                accumulation=c.run.gradient_accumulation_steps, max_grad_error=c.compression.max_grad_error,
            )  # fmt: skip
            return new if switch else current.policy

        new_policy = ctx.coordinator.share(decide)
        changed = new_policy.fingerprint() != current.policy.fingerprint()
        self.schedule.advance(step, changed)
        if not changed:
            return AdaccEvent(step, "track", None, f"{len(changes)} codec statistics moved"), None
        msg = f"switched policy at step {step}: {describe(new_policy)}"
        if changes:
            msg += "; " + "; ".join(changes[:5])
        logger.info("adacc %s", msg)
        return AdaccEvent(step, "switch", new_policy, msg, metrics(new_policy)), new_policy


class OomRecovery:
    """Out-of-memory errors grow the device reserve; custom loops' steps are re-run.

    Args:
        ctx: the session's shared state.
        planner: the run's plans (all re-planned after an error).
    """

    def __init__(self, ctx: SessionContext, planner: Planner) -> None:
        self.ctx, self.planner = ctx, planner
        self.seen = oom_count(ctx.device)
        self._retry: StepRetry | None = None

    def out_of_memory(self, message: str = "") -> bool:
        """After an out-of-memory error (its `message`): grow the device reserve every plan keeps
        free below the budget (`oom`) and mark every bucket for re-planning before its next
        forward. False where the reserve already left only full recomputation: the error is the
        run's own, and the caller should raise it."""
        ctx = self.ctx
        self.seen = oom_count(ctx.device)
        if self.planner.fixed:
            return False
        budget, static = ctx.budget(), ctx.static_memory().total
        before = ctx.oom_reserve_nbytes
        if at_floor(before, budget, static):
            return False
        ctx.oom_reserve_nbytes = grown_reserve(before, budget, static, message)
        self.planner.mark_stale()
        ctx.events.append(oom_event(ctx.step, before, ctx.oom_reserve_nbytes, message))
        return True

    def check(self) -> None:
        """Before a forward: an out-of-memory error raised since the last check (CUDA's own count,
        or a simulated device's) that nobody reported grows the reserve (a loop or Trainer that
        caught it and goes on: accelerate's ``find_executable_batch_size``, ``auto_find_batch_size``)."""
        if self.ctx.coordinator.distributed:
            return  # one rank's error alone would take it out of lockstep with the others
        seen = oom_count(self.ctx.device)
        if seen > self.seen and self.out_of_memory():
            logger.warning(
                "adacc: an out-of-memory error was raised since the last step; re-planned with "
                "%.1f MiB kept free (Trainers, and session.run_step in a custom loop, re-run the step "
                "themselves)",
                self.ctx.oom_reserve_nbytes / 2**20,
            )
        self.seen = seen

    def run_step(
        self,
        session: Callable[[], Any],
        run: Callable[[Any], Any],
        batches: Iterable[Any] | Mapping[str, Any],
    ) -> list[Any]:
        """`AdaccSession.run_step` (see there); `session` returns the session to re-plan."""
        if isinstance(batches, Mapping):
            batches = [batches]
        if self.ctx.coordinator.distributed or self.planner.fixed:
            return [run(b) for b in batches]
        if self._retry is None:
            self._retry = StepRetry(session, self.ctx.model, self.ctx.device)
        return self._retry.whole_step(run, batches)
