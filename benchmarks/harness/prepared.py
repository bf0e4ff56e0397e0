"""A strategy prepared for one model, micro-batch and budget, and how each kind installs.

`Prepared` does the one-time work (profiling, solving, building a policy) in `prepare`, then is
entered and left around training steps as often as a benchmark likes (interleaving strategies
round-robin cancels machine noise). Entering installs the strategy; leaving uninstalls it,
restores every module's checkpointing attributes and raises `PatchLeftError` if anything differs
from before. The kinds:

* `NoCheckpointing`: nothing to install;
* `HFCheckpointing`: transformers' own activation checkpointing (optionally with CPU offload);
* `RulePolicy`: a fixed per-op policy from a rule (``adacc_hf.uniform_policy`` & co.);
* `SolvedPolicy`: Adacc's MILP policy for the budget (static);
* `EvolvingPolicy`: the same, then Adacc's evolution (tracking steps, re-solve, switch);
* `CompiledBudget`: ``torch.compile`` with the partitioner's ``activation_memory_budget``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch import nn

from adacc_hf import AdaccHandle, Policy, apply_adacc
from adacc_hf.engine.session import AdaccSession
from adacc_hf.errors import BudgetError
from adacc_hf.schema import ActionKind

from .adacc import Profiles, profile_for, solved_session
from .patching import (
    check_unchanged,
    hf_disable,
    hf_enable,
    liger_disable,
    liger_enable,
    patch_state,
    restore,
    snapshot,
)


class Strategy(Protocol):
    """What a prepared strategy reads of its `strategies.Strategy` (kept structural: the registry
    imports this module)."""

    name: str
    label: str
    budgeted: bool


Batch = Mapping[str, Any]


class Prepared:
    """One strategy for one model, micro-batch and budget (see the module docstring)."""

    #: The uniform policy (``"retain"`` / ``"recompute"``) this kind amounts to, for the cost
    #: model's prediction of a kind that installs no per-op policy.
    uniform_equivalent: ActionKind | None = None

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        batch: Batch,
        *,
        budget_nbytes: int | None = None,
        static_nbytes: int = 0,
        profiles: Profiles | None = None,
        profile_repeats: int = 3,
    ) -> None:
        if strategy.budgeted and budget_nbytes is None:
            raise ValueError(f"strategy {strategy.name!r} needs budget_nbytes")
        self.strategy = strategy
        self.model, self.batch = model, batch
        self.budget_nbytes, self.static_nbytes = budget_nbytes, static_nbytes
        self.profiles, self.profile_repeats = profiles, profile_repeats
        self.info: dict[str, Any] = {}
        self.policy: Policy | None = None  # the policy installed (None: not a per-op policy)
        self.fits_budget = True  # False when the solver finds no policy for the budget
        self.steps = 0
        self._prepared = False
        self._entered: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def label(self) -> str:
        return self.strategy.label

    def prepare(self) -> Prepared:
        """The one-time work (profile, solve, build the policy). Safe to call twice."""
        if not self._prepared:
            self._prepared = True
            self._prepare()
        return self

    def __enter__(self) -> Prepared:
        if not self.fits_budget:
            raise BudgetError(f"{self.name}: no policy fits the budget ({self.info.get('error')})")
        self.prepare()
        if self._entered is not None:
            raise RuntimeError(f"strategy {self.name} is already entered")
        self._entered = (patch_state(self.model), snapshot(self.model))
        try:
            self.install()
        except BaseException:
            self.uninstall()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._entered is not None
        (before, saved), self._entered = self._entered, None
        try:
            self.uninstall()
        finally:
            restore(self.model, saved)
        check_unchanged(before, self.model, self.name)

    def after_step(self) -> None:
        """Call after each optimizer step."""
        self.steps += 1

    # what each kind overrides
    def _prepare(self) -> None:
        pass

    def install(self) -> None:
        pass

    def uninstall(self) -> None:
        pass


class NoCheckpointing(Prepared):
    """Autograd keeps what it keeps: the baseline."""

    uniform_equivalent = "retain"


class HFCheckpointing(Prepared):
    """transformers' activation checkpointing of every layer (``offload``: saved on the CPU;
    ``every_n``: only every n-th layer, the others keep their activations; ``liger``: with
    Liger-Kernel's fused linear cross-entropy head)."""

    uniform_equivalent = "recompute"

    def __init__(
        self,
        *args: Any,
        offload: bool = False,
        every_n: int = 1,
        liger: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.offload, self.every_n, self.liger = offload, every_n, liger
        if every_n > 1 or liger:
            self.uniform_equivalent = None  # no uniform policy (of the model's head) amounts to it

    def install(self) -> None:
        hf_enable(self.model, offload=self.offload, every_n=self.every_n)
        if self.liger:
            liger_enable(self.model)

    def uninstall(self) -> None:
        if self.liger:
            liger_disable(self.model)
        hf_disable(self.model)


class CompiledBudget(Prepared):
    """The model's forward under ``torch.compile``, its saved activations chosen by AOTAutograd's
    partitioner under ``torch._functorch.config.activation_memory_budget = fraction`` (1: keep
    what the compiled graph needs, 0: recompute all it can). The knob is read when a graph
    compiles: the first step after installing a fraction other than the last one compiled starts
    from an empty compile cache (`torch._dynamo.reset`), so time its steps after a warm-up."""

    _compiled_fraction: float | None = None  # of the cache (process-wide, as dynamo's)

    def __init__(self, *args: Any, fraction: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fraction = fraction
        self._config: tuple[Any, float] | None = None

    def install(self) -> None:
        import torch
        import torch._functorch.config as functorch_config

        if CompiledBudget._compiled_fraction != self.fraction:
            torch._dynamo.reset()
            CompiledBudget._compiled_fraction = self.fraction
        self._config = (functorch_config, functorch_config.activation_memory_budget)
        functorch_config.activation_memory_budget = self.fraction
        self.model.forward = torch.compile(type(self.model).forward.__get__(self.model))

    def uninstall(self) -> None:
        self.model.__dict__.pop("forward", None)
        if self._config is not None:
            config, value = self._config
            config.activation_memory_budget = value
            self._config = None


class AppliedPolicy(Prepared):
    """A per-op policy applied with `adacc_hf.apply_adacc` on entry and removed on exit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handle: AdaccHandle | None = None
        self.fallbacks: set[str] = set()  # ops a codec could not encode (kept exact), any entry

    def install(self) -> None:
        assert self.policy is not None
        self.handle = apply_adacc(self.model, self.policy)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.fallbacks |= self.handle.fallbacks
            self.handle.remove()
            self.handle = None


class RulePolicy(AppliedPolicy):
    """A fixed policy, ``rule(model, batch)`` (``adacc_hf.uniform_policy`` & co.)."""

    def __init__(
        self, *args: Any, rule: Callable[[nn.Module, Batch], Policy], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rule = rule

    def _prepare(self) -> None:
        self.policy = self.rule(self.model, self.batch)


class SolvedPolicy(AppliedPolicy):
    """Adacc's MILP policy for the budget, solved once from the shared profile (``no_outlier``:
    from the ablation's profile, int4_naive in place of int4_outlier)."""

    adaptive = False

    def __init__(self, *args: Any, no_outlier: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.no_outlier = no_outlier
        self.session: AdaccSession | None = None

    def _prepare(self) -> None:
        assert self.budget_nbytes is not None  # `Strategy.budgeted`: checked on construction
        p = self.profiles
        if p is None or (self.no_outlier and p.no_outlier is None):
            p = self.profiles = profile_for(
                self.model, self.batch, self.profile_repeats, no_outlier=self.no_outlier
            )
        t0 = time.perf_counter()
        try:
            self.session = solved_session(
                self.model,
                p.no_outlier if self.no_outlier else p.adacc,
                self.budget_nbytes,
                self.static_nbytes,
                adaptive=self.adaptive,
                profile_repeats=self.profile_repeats,
                probes=p.probes,
            )
        except BudgetError as e:
            self.fits_budget = False
            self.info["error"] = str(e).split(". ")[0]
            return
        self.policy = policy = self.session.policy
        self.info.update(
            profile_s=p.profile_s,
            plan_s=time.perf_counter() - t0,  # solves, and its tables measured and timed
            solve_ms=float(policy.metadata.get("solve_ms", float("nan"))),
            solver_status=policy.metadata.get("status"),
            predicted=policy.metadata.get("predicted", {}),
            summary=policy.summary(),
        )


class EvolvingPolicy(SolvedPolicy):
    """`SolvedPolicy`, then Adacc's evolution: tracking steps, re-solving, switching policies. The
    session (its schedule and a tracking step under way) carries over from entry to entry."""

    adaptive = True

    def install(self) -> None:
        s = self.session
        assert s is not None
        if s.handle is None:  # first entry: apply the solved policy, step 1 begins
            s.setup(self.batch)
            s.on_step_begin(1)
        else:
            s.apply(s.policy)
            # a tracking step under way
            if s.rectifier.tracker is not None and s.handle is not None:
                s.handle.set_tracker(s.rectifier.tracker)

    def uninstall(self) -> None:
        if self.session is not None:
            if self.session.handle is not None:
                self.fallbacks |= self.session.handle.fallbacks
            self.session.close()

    def after_step(self) -> None:
        super().after_step()
        s = self.session
        if s is not None and s.active:
            event = s.step_done(self.steps)
            if event is not None and event.kind == "switch":
                self.info.setdefault("switches", []).append(event.step)
            self.info["tracking_steps"] = list(s.schedule.history)
            self.policy = s.policy
