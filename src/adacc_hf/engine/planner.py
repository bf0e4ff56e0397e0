"""`Planner`: a bucket of batch shapes -> its plan, through the profile store and the solver.

The session plans one policy per *bucket* of batch shapes (`shapes`): the first batch of a bucket
is profiled (padded up to the bucket's edge, under the run's autocast) and solved; later batches
of the bucket reuse that plan, so every batch of the run holds no more than what was planned. A
policy given by the user applies to every shape as it is (`fixed`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..adapters.plain import plain_model
from ..errors import BudgetError
from ..policy import Policy
from ..policy.display import describe, metrics
from ..profiler import BlockProbe
from ..profiler.phases import format_phases, recording
from ..runtime.allocator import use_expandable_segments
from ..runtime.context import outside_autocast
from ..runtime.plain import check_forward
from ..schema import Profile
from ..solver import budget_window
from .context import SessionContext
from .facts import detect_autocast
from .guard import ReservedGuard
from .plans import AdaccEvent, Plan
from .profiles import ProfileStore, serves
from .reserved import ReservedFit
from .shapes import ShapeKey, exact_key, key_text, shape_key
from .solving import BucketSolver

logger = logging.getLogger("adacc_hf")

__all__ = ["Planner"]


class Planner:
    """The plans of a run, one per bucket (see the module docstring).

    Args:
        ctx: the session's shared state.
        store: the session's profiles.
        solver: solves a bucket's profile under the budget.
        guard: the reserved-memory guard (a new bucket keeps the largest reserve it learnt).
        policy: a user's policy (for every shape), or a resumed run's (for its bucket).
        profile: the profile `policy` was solved on (a resumed run).
    """

    def __init__(
        self,
        ctx: SessionContext,
        store: ProfileStore,
        solver: BucketSolver,
        guard: ReservedGuard,
        policy: Policy | None = None,
        profile: Profile | None = None,
    ) -> None:
        self.ctx, self.store, self.solver, self.guard = ctx, store, solver, guard
        self.reserved = ReservedFit(ctx, solver)  # plans fitted to the allocator's reserved peak
        self.plans: dict[ShapeKey | None, Plan] = {}
        self.current: Plan | None = None  # the plan the model runs
        self.fixed = policy is not None and profile is None  # a user's policy, for every shape
        if policy is not None:
            key = None if self.fixed else tuple(policy.metadata.get("shape_key") or ()) or None
            self.current = self.plans[key] = Plan(key, policy, profile)
            self.fixed = key is None
        # plans and profiles made under another autocast than the forwards now run under
        self._shelved: dict[torch.dtype | None, tuple[dict, dict]] = {}
        self._warned: set[str] = set()

    def key_of(self, batch: Mapping[str, Any]) -> ShapeKey:
        """The bucket of `batch`, agreed on by every rank (the largest of theirs)."""
        ctx = self.ctx
        if plain_model(ctx.model) is not None:  # never padded: each shape as it comes
            return ctx.coordinator.agree(exact_key(batch))
        encoder_decoder = bool(getattr(getattr(ctx.model, "config", None), "is_encoder_decoder", 0))
        key = shape_key(batch, encoder_decoder, ctx.config.memory.max_seq_len)
        return ctx.coordinator.agree(key)

    def step_ended(self, step: int, guard: bool) -> None:
        """After optimizer step `step`: plans whose interpolated memory the step disproved are
        measured in full (`guard.DerivedCheck`); with `guard`, the plan that ran is re-planned
        where CUDA reserved past the budget (`guard.ReservedGuard`, its event logged)."""
        ctx = self.ctx
        for plan in ctx.derived_check.step_ended(ctx.device, ctx.coordinator.agree):
            self.measure_in_full(plan)
        if guard:
            event = self.guard.check(
                self.current, ctx.budget_nbytes, ctx.device, step, ctx.coordinator.agree
            )
            if event is not None:
                ctx.events.append(event)

    def longest_key(self, batch: Mapping[str, Any]) -> ShapeKey | None:
        """`batch`'s bucket stretched to the run's longest sequence (``max_seq_len``), planned up
        front so a budget too small for it fails at once; None where nothing is stretched (no
        ``max_seq_len``, a fixed policy, a plain model's exact shapes)."""
        ctx = self.ctx
        if not ctx.config.memory.max_seq_len or self.fixed or plain_model(ctx.model) is not None:
            return None
        key = self.key_of(batch)
        return (key[0], *(max(k, ctx.config.memory.max_seq_len) for k in key[1:-1]), key[-1])

    def first_plan(self, batch: Mapping[str, Any], forward: bool) -> Plan:
        """The plan a run starts on (`AdaccSession.setup`): a plain model's forward checked first,
        the autocast read (off the model's forward where `forward`), the allocator set up, the
        longest bucket planned where ``max_seq_len`` stretches it (a budget too small for it
        fails now), then `batch`'s bucket."""
        ctx = self.ctx
        if plain_model(ctx.model) is not None:
            with ctx.own_forwards():  # its blocks and loss, checked before any profiling
                check_forward(ctx.model, batch)
        if ctx.autocast is None:
            ctx.autocast = detect_autocast(ctx.device, ctx.model if forward else None)
        use_expandable_segments(ctx.config.memory.expandable_segments)
        longest = self.longest_key(batch)
        if longest is not None:
            self.plan(batch, longest)
        return self.plan(batch)

    def plan(self, batch: Mapping[str, Any], key: ShapeKey | None = None) -> Plan:
        """The plan of `batch`'s bucket: profiled (on `batch` padded to the bucket's edge) and
        solved the first time, re-solved when the rectifier moved its codec statistics."""
        if self.fixed:
            return self.plans[None]
        key = key if key is not None else self.key_of(batch)
        plan = self.plans.get(key)
        if plan is not None and not plan.stale:
            return plan
        with outside_autocast(self.ctx.device), recording() as phase_ms:  # as the step runs it
            plan = self._replan(batch, key, plan)
        plan.policy.metadata["planning_ms"] = {k: round(v, 1) for k, v in phase_ms.items()}
        if self.ctx.coordinator.leader:
            logger.info("adacc planning took %s", format_phases(phase_ms))
        return plan

    def _replan(self, batch: Mapping[str, Any], key: ShapeKey, plan: Plan | None) -> Plan:
        ctx, store = self.ctx, self.store
        probes: dict[str, BlockProbe] = {}
        ctx.count_batches_ahead(batch, key)  # the loader's next batch, as large as this one
        reserve = plan.reserve_nbytes if plan is not None else self.guard.learned_nbytes
        room = store.profiling_room(batch)
        if plan is not None:
            profile = plan.profile
        elif key in store.profiles and serves(store.profiles[key], ctx.config.solving.head):
            profile = store.profiles[key]
        else:
            profile, probes = store.profile_bucket(batch, key, room)
        try:
            sample = ctx.padded(batch, key) if probes else None  # the profiled batch
            policy = self.solver.solve_measured(profile, probes, reserve, room, sample)
            policy, reserve = self.reserved.fit(policy, profile, batch, key, reserve, room)
        except BudgetError as e:
            if self.current is None:  # the run's first plans: fail before any work is lost
                raise
            # A batch longer than any planned one, which the budget cannot hold: never silently
            # over budget, and never a crash mid-run where full recomputation trains.
            policy = self.solver.least_memory(profile)
            if "over_budget" not in self._warned:
                self._warned.add("over_budget")
                logger.warning(
                    "adacc: a batch of shape %s does not fit the budget under any policy (%s); "
                    "it runs with full recomputation. Set adacc_max_seq_len (or max_length) to the "
                    "run's longest batch so this is caught before training starts.",
                    key_text(key),
                    e,
                )
        policy.metadata["shape_key"] = list(key)
        if not self.plans and ctx.coordinator.leader:  # the run's first plan: the range
            acc, head = ctx.config.run.gradient_accumulation_steps, ctx.config.solving.head
            window = budget_window(profile, ctx.static_memory(), ctx.budget(), acc, head)
            logger.info("adacc %s", window)
        plan = self.plans[key] = Plan(key, policy, profile, reserve_nbytes=reserve)
        msg = f"bucket {key_text(key)}: {describe(policy)}"
        ctx.events.append(AdaccEvent(ctx.step, "policy", policy, msg, metrics(policy)))
        if ctx.coordinator.leader:
            logger.info("adacc plan for %s", msg)
        logger.debug("adacc plan for %s:\n%s", key_text(key), policy.table())
        return plan

    def with_policy(self, policy: Policy) -> Plan:
        """A plan of the current bucket that runs `policy` (a rectifier's switch)."""
        cur = self.current
        key, profile = (cur.key, cur.profile) if cur is not None else (None, None)
        reserve = cur.reserve_nbytes if cur is not None else 0
        plan = self.plans[key] = Plan(key, policy, profile, reserve_nbytes=reserve)
        return plan

    def follow_autocast(self) -> bool:
        """Plan under the autocast this training forward runs under where it is not the one the
        plans were made under (a custom loop that called `prepare` before
        ``accelerator.prepare`` wrapped the model in its mixed precision): a policy traced in
        another dtype would recompute every op it meant to keep. Plans of the other autocast are
        kept for when it comes back. True where the plans were switched."""
        ctx = self.ctx
        now = detect_autocast(ctx.device, ctx.model)
        if self.current is None or now == ctx.autocast:
            return False
        logger.info(
            "adacc: training forwards run under autocast %s, the plans were made under %s: "
            "planning again under %s",
            now,
            ctx.autocast,
            now,
        )
        self._shelved[ctx.autocast] = (self.plans, self.store.profiles)
        self.plans, self.store.profiles = self._shelved.pop(now, ({}, {}))
        ctx.autocast = now
        self.current = None
        return True

    def measure_in_full(self, plan: Plan) -> None:
        """Profile `plan`'s bucket anew, its memory measured, before its next batch: a step of it
        allocated more than its interpolated memory predicted (`guard.DerivedCheck`)."""
        self.store.measure_in_full(plan.key)
        self.plans.pop(plan.key, None)
        logger.warning(
            "adacc: bucket %s allocated more than its memory interpolated from %s predicted; "
            "profiling it in full before its next batch",
            key_text(plan.key),
            " and ".join(plan.profile.memory_from),
        )

    def mark_stale(self) -> None:
        """Every bucket is planned again before its next forward (the device reserve grew)."""
        for plan in self.plans.values():
            plan.stale = True
