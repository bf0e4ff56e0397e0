"""`AdaccSession`: profile, solve, apply, and evolve the policy during training.

Every entry point uses it: the Trainer callback, `AdaccTrainer`, and `adacc_hf.prepare` for custom
loops and Accelerate. The session plans one policy per *bucket* of batch shapes (`shapes`): before
each training forward it looks at the batch, and the first batch of a bucket is profiled (padded
up to the bucket's edge, under the run's autocast) and solved; later batches of the bucket reuse
that plan, so every batch of the run holds no more than what was planned. A policy given by the
user applies to every shape as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..adapters import unwrap_model
from ..adapters.forward import call_batch
from ..adapters.plain import plain_model
from ..errors import AdaccError, BudgetError
from ..evolution import OutlierTracker, TrackingSchedule
from ..policy import Policy
from ..policy.display import describe, metrics
from ..profiler import BlockProbe
from ..profiler.phases import format_phases, recording
from ..runtime import AdaccHandle, apply_adacc
from ..runtime.allocator import use_expandable_segments
from ..runtime.capacity import oom_count
from ..runtime.checkpoint import own_eager_runs
from ..runtime.context import outside_autocast
from ..runtime.peak import live_state_nbytes
from ..runtime.plain import check_forward
from ..runtime.quantized import check_trainable
from ..schema import Profile
from ..solver import (
    StaticMemory,
    budget_window,
    estimate_static_memory,
    parse_budget,
)
from .config import AdaccConfig, detect_autocast
from .coordinator import Coordinator, coordinator_for_process
from .guard import DerivedCheck, ReservedGuard
from .plans import AdaccEvent, Plan
from .profiling import serves
from .shapes import ShapeKey, exact_key, key_text, shape_key
from .steps import StepHooks

logger = logging.getLogger("adacc_hf")

__all__ = ["AdaccConfig", "AdaccEvent", "AdaccSession", "Plan"]


class AdaccSession(StepHooks):
    """Owns the plans (profile + policy per bucket), the patch on the model and the rectifier
    (its per-step part: `steps.StepHooks`; profiling a bucket: `profiling.SessionProfiling`; solving
    it: `solving.SessionSolving`)."""

    def __init__(
        self,
        model: nn.Module,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | None = None,
        profile: Profile | None = None,
        coordinator: Coordinator | None = None,
        profiles: dict[ShapeKey, Profile] | None = None,
    ) -> None:
        if profile is not None and policy is None:
            raise AdaccError(
                "AdaccSession(profile=...) goes with the policy solved on it (a resumed run); to "
                "reuse a profile for planning, pass profiles={shape_key(batch): profile}"
            )
        self.model = unwrap_model(model)
        # Profiles by bucket, shared by sessions of the same model (a benchmark's budgets).
        self.profiles = profiles if profiles is not None else {}
        self.config = config or AdaccConfig()
        # Distributed runs: every rank profiles and tracks in lockstep (on the bucket all ranks
        # agree on); the coordinator's leader alone solves and decides.
        self.coordinator = coordinator or coordinator_for_process()
        self.plans: dict[ShapeKey | None, Plan] = {}
        self.fixed = policy is not None and profile is None  # a user's policy, for every shape
        self.current: Plan | None = None
        if policy is not None:
            key = None if self.fixed else tuple(policy.metadata.get("shape_key") or ()) or None
            self.current = self.plans[key] = Plan(key, policy, profile)
            self.fixed = key is None
        self.handle: AdaccHandle | None = None
        self.schedule = TrackingSchedule(self.config.max_tracking_interval)
        self.events: list[AdaccEvent] = []
        self.static: StaticMemory | None = None
        self.budget_nbytes: int | None = None
        self.autocast: torch.dtype | None = self.config.autocast
        # plans and profiles made under another autocast than the forwards now run under
        self._shelved: dict[torch.dtype | None, tuple[dict, dict]] = {}
        self._hook: Any = None
        self._planning = False
        self._tracker: OutlierTracker | None = None
        self.guard = ReservedGuard()
        self.derived_check = DerivedCheck()
        # Kept free below the budget by every plan after out-of-memory errors (`oom`).
        self.oom_reserve_nbytes = 0
        self._ooms_seen = oom_count(self.device)
        self._warned: set[str] = set()
        self.step = 0
        # The automatic micro-batch's choice (`autobatch`), for loops that build their own batches.
        self.micro_batch: int | None = None
        self.accumulation: int | None = None
        self.batch_choice: Any = None  # `autobatch.BatchChoice`
        self.init_profiling()

    # ------------------------------------------------------------------ plans
    @property
    def static_nbytes(self) -> int | None:
        return self.static.total if self.static is not None else None

    def _static(self) -> StaticMemory:
        if self.static is None:
            self.static = estimate_static_memory(self.model, **self.config.static_options())
        return self.static

    def _budget(self) -> int:
        if self.budget_nbytes is None:
            # "auto" counts the free memory and what the plan itself counts (already resident).
            resident = live_state_nbytes(self.model)
            self.budget_nbytes = parse_budget(self.config.budget, self.device, resident)
        return self.budget_nbytes

    def key_of(self, batch: Mapping[str, Any]) -> ShapeKey:
        """The bucket of `batch`, agreed on by every rank (the largest of theirs)."""
        if plain_model(self.model) is not None:  # never padded: each shape as it comes
            return self.coordinator.agree(exact_key(batch))
        config = self.model.config
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        return self.coordinator.agree(shape_key(batch, encoder_decoder, self.config.max_seq_len))

    def plan(self, batch: Mapping[str, Any], key: ShapeKey | None = None) -> Plan:
        """The plan of `batch`'s bucket: profiled (on `batch` padded to the bucket's edge) and
        solved the first time, re-solved when the rectifier moved its codec statistics."""
        if self.fixed:
            return self.plans[None]
        key = key if key is not None else self.key_of(batch)
        plan = self.plans.get(key)
        if plan is not None and not plan.stale:
            return plan
        with outside_autocast(self.device), recording() as phase_ms:  # as the step runs it
            plan = self._replan(batch, key, plan)
        plan.policy.metadata["planning_ms"] = {k: round(v, 1) for k, v in phase_ms.items()}
        if self.coordinator.leader:
            logger.info("adacc planning took %s", format_phases(phase_ms))
        return plan

    def _replan(self, batch: Mapping[str, Any], key: ShapeKey, plan: Plan | None) -> Plan:
        probes: dict[str, BlockProbe] = {}
        self.count_batches_ahead(batch, key)  # the loader's next batch, as large as this one
        reserve = plan.reserve_nbytes if plan is not None else self.guard.learned_nbytes
        room = self.profiling_room(batch)
        if plan is not None:
            profile = plan.profile
        elif key in self.profiles and serves(self.profiles[key], self.config.head):
            profile = self.profiles[key]
        else:
            profile, probes = self.profile_bucket(batch, key, room)
        try:
            sample = self._padded(batch, key) if probes else None  # the profiled batch
            policy = self.solve_measured(profile, probes, reserve, room, sample)
        except BudgetError as e:
            if self.current is None:  # the run's first plans: fail before any work is lost
                raise
            # A batch longer than any planned one, which the budget cannot hold: never silently
            # over budget, and never a crash mid-run where full recomputation trains.
            policy = self.least_memory(profile)
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
        if not self.plans and self.coordinator.leader:  # the run's first plan: the range
            acc, head = self.config.gradient_accumulation_steps, self.config.head
            window = budget_window(profile, self._static(), self._budget(), acc, head)
            logger.info("adacc %s", window)
        plan = self.plans[key] = Plan(key, policy, profile, reserve_nbytes=reserve)
        msg = f"bucket {key_text(key)}: {describe(policy)}"
        self.events.append(AdaccEvent(self.step, "policy", policy, msg, metrics(policy)))
        if self.coordinator.leader:
            logger.info("adacc plan for %s", msg)
        logger.debug("adacc plan for %s:\n%s", key_text(key), policy.table())
        return plan

    def setup(self, batch: Mapping[str, Any], forward: bool = False) -> Policy:
        """Plan `batch`'s bucket (and, when ``max_seq_len`` is set, the longest one, so a budget
        too small for it fails now) and patch the model with the plan of `batch` (`forward`:
        called as a training forward starts)."""
        with self.own_forwards():  # a plain model's blocks and loss, before any profiling
            check_forward(self.model, batch)
        if self.autocast is None:
            self.autocast = detect_autocast(self.device, self.model if forward else None)
        use_expandable_segments(self.config.expandable_segments)
        if self.config.max_seq_len and not self.fixed and plain_model(self.model) is None:
            key = self.key_of(batch)
            longest = (key[0], *(max(k, self.config.max_seq_len) for k in key[1:-1]), key[-1])
            self.plan(batch, longest)
        self.use(self.plan(batch))
        return self.policy

    def follow_autocast(self) -> None:
        """Plan under the autocast this training forward runs under where it is not the one the
        plans were made under (a custom loop that called `prepare` before
        ``accelerator.prepare`` wrapped the model in its mixed precision): a policy traced in
        another dtype would recompute every op it meant to keep. Plans of the other autocast are
        kept for when it comes back."""
        now = detect_autocast(self.device, self.model)
        if self.current is None or now == self.autocast:
            return
        logger.info(
            "adacc: training forwards run under autocast %s, the plans were made under %s: "
            "planning again under %s",
            now,
            self.autocast,
            now,
        )
        self._shelved[self.autocast] = (self.plans, self.profiles)
        self.plans, self.profiles = self._shelved.pop(now, ({}, {}))
        self.autocast = now
        self.current = None

    def use(self, plan: Plan) -> None:
        """Run `plan`'s policy from the next forward on."""
        if plan is self.current and self.active:
            return
        self.model.__dict__["_adacc_session"] = self
        if self.handle is not None and self.handle.active:
            self.handle.set_policy(plan.policy)
        else:
            link = self._link  # the cap its plans were made for (None: the default cap)
            cap = link.host_cap_nbytes if link is not None else None
            self.handle = apply_adacc(self.model, plan.policy, host_cap=cap or None)
        self.current = plan
        if self._tracker is not None:
            self.handle.set_tracker(self._tracker)

    def apply(self, policy: Policy) -> None:
        """Run `policy` for the current bucket."""
        cur = self.current
        key, profile = (cur.key, cur.profile) if cur is not None else (None, None)
        reserve = cur.reserve_nbytes if cur is not None else 0
        plan = self.plans[key] = Plan(key, policy, profile, reserve_nbytes=reserve)
        self.current = None
        self.use(plan)

    def attach(self) -> None:
        """Plan and switch policies before each training forward (the first one profiles)."""
        if self._hook is not None:
            return
        self.model.__dict__["_adacc_session"] = self
        quantized = [p for p in self.model.parameters() if hasattr(p, "quant_state")]

        def before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if not module.training or self._planning:  # evaluation, or our own profiling forwards
                return None
            # A training forward builds no KV cache: asked for by the config's default, each
            # checkpointed layer would drop it with transformers' "Caching is incompatible with
            # gradient checkpointing" warning, though the user enabled no checkpointing.
            config = getattr(module, "config", None)  # none on a plain PyTorch model
            if kwargs.get("use_cache") is None and getattr(config, "use_cache", False):
                kwargs["use_cache"] = False
            batch = call_batch(module, args, kwargs)
            self.check_oom()
            if any(getattr(p.quant_state, "packing_format_for_cpu", False) for p in quantized):
                check_trainable(self.model)  # bitsandbytes' inference repack: no backward
            if self.config.autocast is None and not self.fixed:
                self.follow_autocast()
            with own_eager_runs():
                if self.current is None or not self.active:
                    self.setup(batch, forward=True)
                else:
                    self.use(self.plan(batch))
            self.derived_check.step_uses(self.current, self.device)
            head = self.handle.head if self.handle is not None else None
            if head is not None:  # installed in this hook: torch will not call its pre-hook now
                head.arm(module, kwargs)
            return args, kwargs

        # Under torch.compile the hook runs eagerly (a graph break before the model): planning
        # profiles, solves and patches, none of which a compiled graph may trace.
        self._hook = self.model.register_forward_pre_hook(
            torch.compiler.disable(before_forward), with_kwargs=True
        )

    def detach_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def drain_events(self) -> list[AdaccEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        """Undo everything on the model (the policy and profile stay readable)."""
        self.detach_hook()
        if self.handle is not None:
            self.handle.set_tracker(None)
            self.handle.remove()
        if self.model.__dict__.get("_adacc_session") is self:
            del self.model.__dict__["_adacc_session"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "config": asdict(self.config),
            "step": self.step,
        }
