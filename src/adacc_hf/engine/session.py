"""`AdaccSession`: profile, solve, apply, and evolve the policy during training.

Every entry point uses it: the Trainer callback, `AdaccTrainer`, and `adacc_hf.prepare` for custom
loops and Accelerate. The session holds its parts, each an object with its own state around one
`context.SessionContext`: the profiles (`profiles.ProfileStore`), the solver
(`solving.BucketSolver`), the plans per bucket of batch shapes (`planner.Planner`), the rectifier
and out-of-memory recovery (`tracking`), the reserved-memory guard (`guard`), and what it changes
on the model (`patch.ModelPatch`: the runtime's patch, the planning hook before each training
forward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from ..adapters import unwrap_model
from ..errors import AdaccError
from ..policy import Policy
from ..runtime import AdaccHandle
from ..schema import Profile
from .config import AdaccConfig
from .context import SessionContext
from .coordinator import Coordinator, coordinator_for_process
from .guard import ReservedGuard
from .patch import ModelPatch
from .planner import Planner
from .plans import AdaccEvent, Plan
from .profiles import ProfileStore
from .shapes import ShapeKey
from .solving import BucketSolver
from .tracking import OomRecovery, Rectifier

logger = logging.getLogger("adacc_hf")

__all__ = ["AdaccConfig", "AdaccEvent", "AdaccSession", "Plan"]


class _OnContext:
    """An attribute of the session that lives on its `SessionContext` (read and set there)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, session: Any, owner: type | None = None) -> Any:
        return self if session is None else getattr(session.ctx, self.name)

    def __set__(self, session: Any, value: Any) -> None:
        setattr(session.ctx, self.name, value)


def _adopted(
    choice: Any, config: AdaccConfig | None, profiles: dict[ShapeKey, Profile] | None
) -> tuple[AdaccConfig, Policy, Profile, dict[ShapeKey, Profile]]:
    """A session's config, policy, profile and profiles on the automatic micro-batch's `choice`
    (an `autobatch.BatchChoice`: that module imports this one, so the type is not named here)."""
    config = (config or AdaccConfig()).with_run(gradient_accumulation_steps=choice.accumulation)
    return config, choice.policy, choice.profile, {**choice.profiles, **(profiles or {})}


class AdaccSession:
    """Owns the plans (profile + policy per bucket), the patch on the model and the rectifier.

    Args:
        model: the model to train (wrapped models are unwrapped).
        config: the options (default: `AdaccConfig()`).
        policy: a policy to run: the user's (for every shape), or a resumed run's with `profile`.
        profile: the profile `policy` was solved on (a resumed run).
        coordinator: who decides across ranks (default: the process group's, if any).
        profiles: profiles by bucket to plan from (shared by sessions of the same model).
        choice: the automatic micro-batch's choice (`autobatch.BatchChoice`): the session runs
            its policy at its accumulation, plans from its profiles and logs it.

    Raises:
        AdaccError: `profile` without `policy` (to plan from a profile, pass `profiles`).
    """

    def __init__(
        self,
        model: nn.Module,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | None = None,
        profile: Profile | None = None,
        coordinator: Coordinator | None = None,
        profiles: dict[ShapeKey, Profile] | None = None,
        choice: Any = None,
    ) -> None:
        if choice is not None:
            config, policy, profile, profiles = _adopted(choice, config, profiles)
        if profile is not None and policy is None:
            raise AdaccError(
                "AdaccSession(profile=...) goes with the policy solved on it (a resumed run); to "
                "reuse a profile for planning, pass profiles={shape_key(batch): profile}"
            )
        # Distributed runs: every rank profiles and tracks in lockstep (on the bucket all ranks
        # agree on); the coordinator's leader alone solves and decides.
        ctx = SessionContext(
            unwrap_model(model), config or AdaccConfig(), coordinator or coordinator_for_process()
        )
        self.ctx = ctx
        self.store = ProfileStore(ctx, profiles)
        self.solver = BucketSolver(ctx)
        self.guard = ReservedGuard()
        self.planner = Planner(ctx, self.store, self.solver, self.guard, policy, profile)
        self.rectifier = Rectifier(ctx, self.planner)
        self.oom = OomRecovery(ctx, self.planner)
        self.patch = ModelPatch(ctx.model, self)
        # The automatic micro-batch's choice (`autobatch`), for loops that build their own batches.
        self.batch_choice = choice
        self.micro_batch: int | None = getattr(choice, "micro_batch", None)
        self.accumulation: int | None = getattr(choice, "accumulation", None)
        if choice is not None:
            ctx.events.append(choice.event())

    # ------------------------------------------------------------ what callers read
    model = _OnContext("The (unwrapped) model the session plans for.")
    config = _OnContext("The session's options (`AdaccConfig`).")
    coordinator = _OnContext("Who decides across ranks (set: another decides from now on).")
    device = property(lambda self: self.ctx.device)
    derived_check = property(lambda self: self.ctx.derived_check)
    events = property(lambda self: self.ctx.events)
    plans = property(lambda self: self.planner.plans)
    profiles = property(lambda self: self.store.profiles)
    current = property(lambda self: self.planner.current)
    fixed = property(lambda self: self.planner.fixed)
    schedule = property(lambda self: self.rectifier.schedule)

    step = _OnContext("The optimizer step the session is at (1-based; 0 before training).")
    autocast = _OnContext("The autocast dtype plans are made under (None: none, or not known yet).")
    static = _OnContext("The step's static memory, once computed (set: plan with this one).")
    budget_nbytes = _OnContext("The budget in bytes, once resolved.")
    oom_reserve_nbytes = _OnContext(
        "Bytes every plan keeps free below the budget after out-of-memory errors."
    )

    static_nbytes = property(
        lambda self: self.ctx.static.total if self.ctx.static is not None else None,
        doc="The step's static memory in bytes, once computed.",
    )

    @property
    def policy(self) -> Policy | None:
        """The policy the model runs now."""
        return self.current.policy if self.current is not None else None

    @property
    def profile(self) -> Profile | None:
        """The profile of the plan the model runs now."""
        return self.current.profile if self.current is not None else None

    @property
    def handle(self) -> AdaccHandle | None:
        """The runtime's patch on the model (`runtime.apply_adacc`), once a policy ran."""
        return self.patch.handle

    @property
    def active(self) -> bool:
        """Whether a policy runs on the model now."""
        return self.patch.active

    # ------------------------------------------------------------------ plans
    def key_of(self, batch: Mapping[str, Any]) -> ShapeKey:
        """The bucket of `batch` (`shapes.shape_key`), agreed on by every rank (their largest).

        Args:
            batch: a training micro-batch (a mapping of the forward's arguments by name).

        Returns:
            The bucket's key.
        """
        return self.planner.key_of(batch)

    def plan(self, batch: Mapping[str, Any], key: ShapeKey | None = None) -> Plan:
        """The plan of `batch`'s bucket (`Planner.plan`); the model is not switched to it.

        Profiled and solved the first time, re-solved when the rectifier moved its codec
        statistics; raises `BudgetError` where no policy of the bucket fits the budget.

        Args:
            batch: a training micro-batch of the bucket.
            key: the bucket to plan (None: `batch`'s, `key_of`).

        Returns:
            The bucket's `Plan`.
        """
        return self.planner.plan(batch, key)

    def reuse_profiles(self, profiles: list[Profile], source: str) -> None:
        """Plan from saved profiles where one's fingerprint is this run's (others: profiled anew).

        Args:
            profiles: an earlier run's profiles (its ``adacc_profiles.json``).
            source: where they were read from, for the log.
        """
        self.store.reuse_profiles(profiles, source)

    def setup(self, batch: Mapping[str, Any], forward: bool = False) -> Policy:
        """Plan `batch`'s bucket and patch the model with its plan (`Planner.first_plan`).

        Args:
            batch: a training micro-batch (a mapping of the forward's arguments by name).
            forward: called as a training forward starts (the run's autocast is then read off
                the model's forward, not guessed).

        Returns:
            The policy the model now runs.

        Raises:
            BudgetError: no policy fits the budget.
            UnsupportedModelError: a plain model's blocks or loss do not run as named.
        """
        self.use(self.planner.first_plan(batch, forward))
        return self.policy

    def start(self, batch: Mapping[str, Any] | None) -> None:
        """Plan `batch` now where given (`setup`), and before each training forward from now on.

        Args:
            batch: a training micro-batch (None: the first training forward's).
        """
        if batch is not None:
            self.setup(batch)
            self.on_step_begin(1)
        # every training forward plans its batch's bucket first (a longer batch than the sample's
        # gets a plan of its own; a bucket the guard marked gets re-planned)
        self.attach()

    def use(self, plan: Plan) -> None:
        """Run `plan`'s policy from the next forward on.

        Args:
            plan: a plan of this session (`plan`).
        """
        if plan is self.current and self.active:
            return
        link = self.solver._link  # the cap its plans were made for (None: the default cap)
        cap = link.host_cap_nbytes if link is not None else None
        self.patch.run(plan.policy, self.rectifier.tracker, host_cap=cap)
        self.planner.current = plan

    def apply(self, policy: Policy) -> None:
        """Run `policy` for the current bucket.

        Args:
            policy: a policy for this model.
        """
        plan = self.planner.with_policy(policy)
        self.planner.current = None
        self.use(plan)

    def attach(self) -> None:
        """Plan and switch policies before each training forward (the first one profiles)."""
        self.patch.hook()

    # ------------------------------------------------------------------ steps
    def on_step_begin(self, step: int) -> None:
        """Call before the forward of optimizer step `step`; arms the rectifier on tracking steps.

        Args:
            step: the optimizer step about to run (1-based).
        """
        self.ctx.step = step
        if self.active:
            tracker = self.rectifier.arm(step)
            if tracker is not None:
                self.patch.set_tracker(tracker)

    def on_step_end(self, step: int) -> AdaccEvent | None:
        """Call after optimizer step `step`: the reserved-memory guard, and the rectifier.

        Args:
            step: the optimizer step that ended (1-based).

        Returns:
            The tracking step's event (a switch when the policy changed), or None on other steps.
        """
        self.planner.step_ended(step, guard=self.active and not self.fixed)
        tracker, self.rectifier.tracker = self.rectifier.tracker, None
        if tracker is None or not self.active:
            return None
        self.patch.set_tracker(None)
        event, new_policy = self.rectifier.decide(step, tracker)
        if new_policy is not None:
            self.apply(new_policy)
        self.ctx.events.append(event)
        return event

    def step_done(self, step: int) -> AdaccEvent | None:
        """For custom loops: call once after each optimizer step (`on_step_end`, `on_step_begin`).

        Args:
            step: the optimizer step just taken (1-based).

        Returns:
            The tracking step's event (a switch when the policy changed), or None on other steps.
        """
        event = self.on_step_end(step)
        self.on_step_begin(step + 1)
        return event

    def out_of_memory(self, message: str = "") -> bool:
        """After an out-of-memory error: grow the device reserve and re-plan every bucket.

        Args:
            message: the error's message (it sizes the reserve's growth; logged).

        Returns:
            False where only full recomputation was left (or the policy is the user's, fixed):
            the error is the run's own and the caller should raise it; else True.
        """
        return self.oom.out_of_memory(message)

    def run_step(
        self, run: Callable[[Any], Any], batches: Iterable[Any] | Mapping[str, Any]
    ) -> list[Any]:
        """Custom loops: run one optimizer step's micro-batches, surviving out of memory.

        A micro-batch that runs out is re-planned and the step's micro-batches run again from the
        first with their own random states: the gradients of a run that never failed (`retry`).

        Args:
            run: one micro-batch's forward and backward (``accelerator.backward`` included;
                step the optimizer after `run_step`); its results are returned in order.
            batches: the step's micro-batches (or one batch).

        Returns:
            ``run``'s result for each micro-batch.

        Raises:
            torch.OutOfMemoryError: even full recomputation does not fit, or the gradients were
                not empty when the step began (a re-run could not restore them); under several
                ranks or a user's fixed policy, every error passes through.
        """
        return self.oom.run_step(lambda: self, run, batches)

    # ------------------------------------------------------------------ lifetime
    def drain_events(self) -> list[AdaccEvent]:
        """Take the events logged since the last call (new plans, switches, tracking steps).

        Returns:
            The events, oldest first; the session keeps none of them.
        """
        events, self.ctx.events = self.ctx.events, []
        return events

    def close(self) -> None:
        """Undo everything on the model (the policy and profile stay readable)."""
        self.patch.remove()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves of the session.

        Returns:
            The tracking schedule's state, the config (as a dict) and the step.
        """
        return {
            "schedule": self.schedule.state_dict(),
            "config": self.config.to_dict(),
            "step": self.step,
        }
