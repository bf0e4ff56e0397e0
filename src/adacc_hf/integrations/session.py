"""`AdaccSession`: profile on a real batch, solve, apply, and evolve the policy during training.

Every entry point uses it: the Trainer callback, `AdaccTrainer`, and `adacc_hf.prepare` for custom
loops and Accelerate. With no policy and no sample batch, `attach()` defers everything to the
model's first training forward, which then profiles on that very batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters import unwrap_model
from ..codecs import CodecError, get_codec
from ..errors import AdaccError
from ..evolution import OutlierTracker, TrackingSchedule
from ..policy import Policy
from ..policy.display import describe, metrics
from ..profiler import profile_model
from ..runtime import AdaccHandle, apply_adacc
from ..runtime.sharded import forwards_without_backward
from ..schema import Profile
from ..solver import (
    HEADROOM,
    estimate_static_memory,
    parse_budget,
    planned_budget,
    predict,
    solve_policy,
)
from .coordinator import Coordinator, coordinator_for_process
from .sharding import sharding_from_model

logger = logging.getLogger("adacc_hf")


@dataclass
class AdaccConfig:
    """What an `AdaccSession` does; `AdaccTrainingArguments` fills it from `adacc_*` fields."""

    budget: int | str = "auto"
    codecs: list[str] | None = None  # codecs the solver may pick (None: each layer type's own)
    zscore_threshold: float = 3.0
    adaptive: bool = True
    max_tracking_interval: int = 1024
    solver: str = "cbc"
    solver_time_limit: float = 10.0
    max_codec_error: float = 0.5
    split_blocks: bool = True
    optimizer: str = "adamw_torch"
    mixed_precision: str | None = None
    zero_stage: int = 0
    fsdp: bool = False
    world_size: int = 1
    offload_optimizer: bool = False
    master_weights: bool = False  # fp32 copies of 16-bit parameters (DeepSpeed mixed precision)
    profile_repeats: int = 3
    # Fraction of the activation share of the budget (budget - static) the solver leaves free for
    # batch-to-batch variation (int4_outlier sizes vary by block and batch) and fragmentation.
    headroom: float = HEADROOM

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < 0.5:
            raise AdaccError(f"headroom must be in [0, 0.5), got {self.headroom}")
        if self.codecs is not None:
            for name in self.codecs:
                try:
                    get_codec(name)
                except CodecError as e:
                    raise AdaccError(f"adacc codecs: {e}") from None
        if self.max_tracking_interval < 1:
            raise AdaccError("max_tracking_interval must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise AdaccError(f"zero_stage must be 0-3, got {self.zero_stage}")

    def codec_params(self) -> dict[str, dict[str, Any]]:
        return {"int4_outlier": {"zscore_threshold": self.zscore_threshold}}


@dataclass
class AdaccEvent:
    """Something worth logging: the first policy, or a switch."""

    step: int
    kind: str  # "policy" | "switch" | "track"
    policy: Policy | None = None
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class AdaccSession:
    """Owns the profile, the policy, the patch on the model and the tracking schedule."""

    def __init__(
        self,
        model: nn.Module,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | None = None,
        profile: Profile | None = None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.model = unwrap_model(model)
        self.config = config or AdaccConfig()
        self.policy = policy
        self.profile = profile
        # Distributed runs: every rank profiles and tracks in lockstep; the coordinator's leader
        # alone solves and decides, and every rank runs its policy.
        self.coordinator = coordinator or coordinator_for_process()
        self.handle: AdaccHandle | None = None
        self.schedule = TrackingSchedule(self.config.max_tracking_interval)
        self.events: list[AdaccEvent] = []
        self.static_nbytes: int | None = None
        self.budget_nbytes: int | None = None
        self._hook: Any = None
        self._tracker: OutlierTracker | None = None
        self.step = 0

    # ------------------------------------------------------------------ set-up
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _static(self) -> int:
        c = self.config
        est = estimate_static_memory(
            self.model,
            optimizer=c.optimizer,
            mixed_precision=c.mixed_precision,
            zero_stage=c.zero_stage,
            fsdp=c.fsdp,
            world_size=c.world_size,
            offload_optimizer=c.offload_optimizer,
            master_weights=c.master_weights,
        )
        return est.total

    def solve(self, profile: Profile) -> Policy:
        """The policy for `profile` under the session's budget (keeping `headroom` free)."""
        if self.budget_nbytes is None:
            self.budget_nbytes = parse_budget(self.config.budget, self.device)
        if self.static_nbytes is None:
            self.static_nbytes = self._static()
        c = self.config
        planned = planned_budget(self.budget_nbytes, self.static_nbytes, profile, c.headroom)
        policy = solve_policy(
            profile,
            planned,
            static_nbytes=self.static_nbytes,
            codecs=c.codecs,
            max_rel_error=c.max_codec_error,
            solver=c.solver,
            time_limit_s=c.solver_time_limit,
            split_blocks=c.split_blocks,
        )
        policy.metadata["budget_spec"] = str(c.budget)
        policy.metadata["budget_nbytes"] = self.budget_nbytes
        policy.metadata["headroom"] = c.headroom
        return policy

    def setup(self, batch: Mapping[str, Any]) -> Policy:
        """Profile on `batch` (unless a policy was given), solve, and patch the model."""
        if self.policy is None:
            if self.profile is None:
                # On every rank: under ZeRO-3 / FSDP these forwards all-gather parameters. Inside
                # a training forward (`attach`), FSDP2's state is left to that step's backward.
                with forwards_without_backward(self.model):
                    self.profile = profile_model(
                        self.model,
                        batch,
                        codecs=self.config.codecs,
                        codec_params=self.config.codec_params(),
                        repeats=self.config.profile_repeats,
                    )
            profile = self.profile
            policy = self.coordinator.share(lambda: self.solve(profile))
        else:
            given = self.policy
            policy = self.coordinator.share(lambda: given)
        self.apply(policy)
        self.events.append(
            AdaccEvent(self.step, "policy", policy, describe(policy), metrics(policy))
        )
        logger.info("adacc policy (%s):\n%s", describe(policy), policy.table())
        return policy

    def apply(self, policy: Policy) -> None:
        self.model.__dict__["_adacc_session"] = self
        if self.handle is not None and self.handle.active:
            self.handle.set_policy(policy)
        else:
            self.handle = apply_adacc(self.model, policy)
        self.policy = policy

    def attach(self) -> None:
        """Defer `setup` to the model's first training forward (which is profiled)."""
        if self._hook is not None or (self.handle is not None and self.handle.active):
            return
        self.model.__dict__["_adacc_session"] = self

        def first_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training:
                return
            self.detach_hook()
            batch = dict(kwargs)
            if args:
                batch.setdefault("input_ids", args[0])
            self.setup(batch)

        self._hook = self.model.register_forward_pre_hook(first_forward, with_kwargs=True)

    def detach_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def active(self) -> bool:
        return self.handle is not None and self.handle.active

    # --------------------------------------------------------------- evolution
    def on_step_begin(self, step: int) -> None:
        """Call before the forward of optimizer step `step` (1-based)."""
        self.step = step
        if (
            self.config.adaptive
            and self.active
            and self.profile is not None
            and self.schedule.is_tracking_step(step)
        ):
            self._tracker = OutlierTracker(self.profile)
            self.handle.set_tracker(self._tracker)

    def on_step_end(self, step: int) -> AdaccEvent | None:
        """Call after optimizer step `step`: on tracking steps, re-solve and maybe switch."""
        tracker, self._tracker = self._tracker, None
        if tracker is None or not self.active:
            return None
        self.handle.set_tracker(None)
        tracker = self.coordinator.merge(tracker)
        new_profile, changes = tracker.apply(self.profile)
        self.profile = new_profile

        def decide() -> Policy:
            new = self.solve(new_profile)
            return new if self._should_switch(new_profile, new) else self.policy

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

    def _should_switch(self, profile: Profile, new: Policy) -> bool:
        """Switch when the current policy no longer fits the budget or uses a codec whose measured
        error is now above the limit, or when the new one is clearly (> 2 %) faster."""
        if new.fingerprint() == self.policy.fingerprint():
            return False
        cur = predict(profile, self.policy, self.static_nbytes or 0)
        if cur.peak_nbytes > (self.budget_nbytes or 0):
            return True
        errors = {
            (g.name, o.key, c.codec): c.rel_error
            for g in profile.groups.values()
            for o in g.ops
            for c in o.codecs.values()
        }
        for gname, gp in self.policy.groups.items():
            for v in gp.variants:
                for key, a in v.actions.items():
                    if a.kind == "compress":
                        err = errors.get((gname, key, a.codec), 0.0)
                        if not err <= self.config.max_codec_error:
                            return True
        best = predict(profile, new, self.static_nbytes or 0)
        return best.added_ms < 0.98 * cur.added_ms

    def step_done(self, step: int) -> AdaccEvent | None:
        """For custom loops: call once after each optimizer step."""
        event = self.on_step_end(step)
        self.on_step_begin(step + 1)
        return event

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

    def restore_schedule(self, state: dict[str, Any]) -> None:
        """Continue a saved tracking schedule (resume)."""
        self.schedule = TrackingSchedule.from_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "config": asdict(self.config),
            "step": self.step,
        }


def prepare(
    model: nn.Module,
    budget: int | str = "auto",
    sample_batch: Mapping[str, Any] | None = None,
    *,
    policy: Policy | str | None = None,
    codecs: Iterable[str] | None = None,
    adaptive: bool = True,
    **config: Any,
) -> AdaccSession:
    """Adacc for custom loops and Accelerate: profile, solve and patch `model`.

    With `sample_batch` this happens now; without, on the model's first training forward. A saved
    `policy` (object or JSON path) skips profiling. With ``adaptive=True`` (the default, as in the
    Trainer) call ``session.step_done(step)`` after each optimizer step: the rectifier re-measures
    the codecs on tracking steps and switches policy when needed; ``adaptive=False`` keeps the
    first policy. Undo with ``session.close()``.

    In a process group of several ranks, call it on every rank: all profile, rank 0 solves, and
    every rank runs (and later switches to) rank 0's policy. ZeRO-3 and FSDP2 sharding is read off
    the model's parameters unless `zero_stage` / `fsdp` / `world_size` are given.
    """
    if isinstance(policy, str):
        policy = Policy.load(policy)
    if not config.keys() & {"zero_stage", "fsdp", "world_size", "offload_optimizer"}:
        config = {**sharding_from_model(model), **config}
    cfg = AdaccConfig(
        budget=budget,
        codecs=list(codecs) if codecs is not None else None,
        adaptive=adaptive,
        **config,
    )
    session = AdaccSession(model, cfg, policy=policy)
    if sample_batch is not None:
        session.setup(sample_batch)
        session.on_step_begin(1)
    else:
        session.attach()
    return session
