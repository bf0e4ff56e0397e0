"""Activation-memory strategies the benchmarks compare, each built the same way for any model.

A `Strategy` is built once for a model, a micro-batch and a memory budget (`prepare`: profile and
solve where it needs to), then entered and left around training steps as often as a benchmark
likes (interleaving strategies round-robin cancels machine noise)::

    s = Strategy("hf_full", model, batch, budget_nbytes=..., static_nbytes=...)
    s.prepare()
    with s:                       # installs; leaving restores the model exactly
        with s.step_context():    # per step (CPU-offload fallback hooks)
            model(**batch).loss.backward()
        s.after_step()            # Adacc's evolution (tracking steps, re-solve, switch)

Strategies (`STRATEGIES`): what users run today (no checkpointing, transformers' full activation
checkpointing with and without CPU offload, Megatron-style selective recompute, naive INT4 on
every saved activation) and Adacc (static policy, with evolution, and without outlier
separation). The accuracy suite adds two fixed policies that compress every saved activation
(`EXTRA_STRATEGIES`) to show what the codecs themselves cost in loss.

Leaving a strategy restores every module's checkpointing attributes and hooks; `patch_state`
snapshots them and `Strategy.__exit__` raises if anything differs afterwards.

Memory: `held_nbytes` (what a forward leaves for backward, measured by
`adacc_hf.activation_memory_report`), `cpu_step_peak_nbytes` (the highest sum of live storages
created during forward + backward, measured op by op on any device) and `cuda_step_peak_nbytes`
(``torch.cuda.max_memory_allocated`` of a whole step).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from adacc_hf import (
    Policy,
    activation_memory_report,
    apply_adacc,
    attention_recompute_policy,
    uniform_policy,
)
from adacc_hf.adapters import CODEC_FOR_LAYER, LAYER_TYPES
from adacc_hf.errors import BudgetError
from adacc_hf.integrations.session import AdaccConfig, AdaccSession
from adacc_hf.profiler import profile_model
from adacc_hf.runtime.ops import is_keyed
from adacc_hf.schema import Profile

#: name -> label, in the order tables and plots show them.
STRATEGIES: dict[str, str] = {
    "none": "no checkpointing",
    "hf_full": "HF full checkpointing",
    "hf_offload": "HF checkpointing + CPU offload",
    "megatron": "Megatron selective (attention core)",
    "naive_int4": "naive INT4 on all activations",
    "adacc": "Adacc (static)",
    "adacc_adaptive": "Adacc + evolution",
    "adacc_no_outlier": "Adacc w/o outlier separation",
}
#: Fixed policies for the accuracy suite (every saved activation compressed).
EXTRA_STRATEGIES: dict[str, str] = {
    "adacc_all": "Adacc codecs on every saved activation",
    "adacc_all_no_outlier": "Adacc codecs on every saved activation, w/o outlier separation",
}
ALL_STRATEGIES = {**STRATEGIES, **EXTRA_STRATEGIES}
#: Strategies whose memory depends on the budget (solved per budget).
BUDGETED = frozenset({"adacc", "adacc_adaptive", "adacc_no_outlier"})
#: The ablation's stand-in for int4_outlier: the same groups of 64 channels, no outlier channels.
NO_OUTLIER_CODEC = ("int4_naive", {"group_size": 64})


def label(name: str) -> str:
    return ALL_STRATEGIES.get(name, name)


# ------------------------------------------------------------------------------------ patching
_ATTRS = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_adacc_handle",
    "_require_grads_hooks",
    "_require_grads_hook",
    "forward",
)
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
)


def patch_state(model: nn.Module) -> dict[str, Any]:
    """What a strategy may change on a model: per module, its checkpointing attributes (by identity
    for objects), its hook ids and its training flag."""
    state = {}
    for name, mod in model.named_modules():
        attrs = {}
        for a in _ATTRS:
            if a in mod.__dict__:
                v = mod.__dict__[a]
                attrs[a] = v if isinstance(v, (bool, int, float, str, type(None))) else id(v)
        hooks = tuple(tuple(getattr(mod, h, {}).keys()) for h in _HOOK_DICTS)
        state[name] = (attrs, hooks, mod.training)
    return state


def _snapshot_attrs(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {
        name: {a: mod.__dict__[a] for a in _ATTRS if a in mod.__dict__}
        for name, mod in model.named_modules()
    }


def _restore_attrs(model: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    for name, mod in model.named_modules():
        before = saved.get(name, {})
        for a in _ATTRS:
            if a in before:
                mod.__dict__[a] = before[a]
            else:
                mod.__dict__.pop(a, None)


class PatchLeftError(RuntimeError):
    """A strategy left something behind on the model."""


def _hf_enable(model: nn.Module, *, offload: bool) -> None:
    """transformers' own activation checkpointing (non-reentrant), as a user switches it on.

    transformers >= 5.23: ``activation_checkpointing_enable(..., offload=)``; before that,
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``. On a machine without an
    accelerator (transformers 5.23 asks for pinned memory there and fails) or a transformers
    without ``offload``, offload is the same wrapper transformers installs: ``save_on_cpu`` around
    each layer's checkpoint.
    """
    kwargs = {"use_reentrant": False}
    new = getattr(model, "activation_checkpointing_enable", None)
    enable = new or model.gradient_checkpointing_enable
    has_offload = "offload" in inspect.signature(enable).parameters
    native_offload = offload and has_offload and torch.cuda.is_available()
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs, **({"offload": True} if native_offload else {}))
    else:
        extra = {"offload": True} if native_offload else {}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    if offload and not native_offload:
        from torch.autograd.graph import save_on_cpu
        from torch.utils.checkpoint import checkpoint

        pin = torch.cuda.is_available()

        def offloaded(function, *args, **kw):
            with save_on_cpu(pin_memory=pin):
                return checkpoint(function, *args, **kw)

        func = functools.partial(offloaded, **kwargs)
        for mod in model.modules():
            if "_gradient_checkpointing_func" in mod.__dict__:
                mod._gradient_checkpointing_func = func


def _hf_disable(model: nn.Module) -> None:
    off = getattr(model, "activation_checkpointing_disable", None) or (
        model.gradient_checkpointing_disable
    )
    off()
    # transformers adds an input-embedding hook on enable and removes it on disable only for PEFT
    with contextlib.suppress(AttributeError):  # older versions: no hook, no attribute
        model.disable_input_require_grads()


# -------------------------------------------------------------------------------- profiles
def no_outlier_profile(profile: Profile, naive: Profile) -> Profile:
    """`profile` with every op's int4_outlier measurement replaced by int4_naive's (same groups of
    64, no outlier channels) from `naive`, a profile of the same model and batch. Op times stay
    those of `profile`, so the solver's choices differ only through the codec."""
    out = copy.deepcopy(profile)
    naive_ops = {(g, o.key): o for g, gp in naive.groups.items() for o in gp.ops}
    for gname, g in out.groups.items():
        for i, op in enumerate(g.ops):
            if "int4_outlier" not in op.codecs:
                continue
            codecs = {k: v for k, v in op.codecs.items() if k != "int4_outlier"}
            other = naive_ops.get((gname, op.key))
            if other is not None and NO_OUTLIER_CODEC[0] in other.codecs:
                codecs[NO_OUTLIER_CODEC[0]] = other.codecs[NO_OUTLIER_CODEC[0]]
            g.ops[i] = replace(op, codecs=codecs)
    return out


@dataclass
class Profiles:
    """Adacc's profile of one model and micro-batch, shared by the Adacc strategies."""

    adacc: Profile
    no_outlier: Profile | None = None
    profile_s: float = 0.0  # wall time of the user-facing profile (adacc's own)


def profile_for(
    model: nn.Module, batch: Mapping[str, Any], repeats: int = 3, *, no_outlier: bool = True
) -> Profiles:
    """The profile `adacc_hf.prepare` makes (each layer type's own codec), plus the ablation's."""
    params = AdaccConfig().codec_params()
    t0 = time.perf_counter()
    prof = profile_model(model, batch, codec_params=params, repeats=repeats)
    took = time.perf_counter() - t0
    naive = None
    if no_outlier:
        codec, p = NO_OUTLIER_CODEC
        raw = profile_model(model, batch, codecs=[codec], codec_params={codec: p}, repeats=1)
        naive = no_outlier_profile(prof, raw)
    return Profiles(prof, naive, took)


# ------------------------------------------------------------------------------ strategies
@dataclass
class Strategy:
    """One strategy for one model, micro-batch and budget (see the module docstring)."""

    name: str
    model: nn.Module
    batch: Mapping[str, Any]
    budget_nbytes: int | None = None
    static_nbytes: int = 0
    profiles: Profiles | None = None
    profile_repeats: int = 3
    info: dict[str, Any] = field(default_factory=dict)
    policy: Policy | None = None
    session: AdaccSession | None = None
    fits_budget: bool = True  # False when the solver finds no policy for the budget
    _handle: Any = None
    _saved: dict[str, dict[str, Any]] | None = None
    _before: dict[str, Any] | None = None
    _step: int = 0
    _entered_once: bool = False

    def __post_init__(self) -> None:
        if self.name not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; known: {', '.join(ALL_STRATEGIES)}")
        if self.name in BUDGETED and self.budget_nbytes is None:
            raise ValueError(f"strategy {self.name!r} needs budget_nbytes")

    @property
    def label(self) -> str:
        return label(self.name)

    # -------------------------------------------------------------- one-time preparation
    def prepare(self) -> Strategy:
        """Build the policy (profiling and solving for Adacc). Safe to call twice."""
        if self.policy is not None or self.session is not None or not self.fits_budget:
            return self
        n, m, b = self.name, self.model, self.batch
        if n == "megatron":
            self.policy = attention_recompute_policy(m, b)
        elif n == "naive_int4":
            self.policy = uniform_policy(
                m, "compress", b, codecs=dict.fromkeys(LAYER_TYPES, "int4_naive")
            )
        elif n == "adacc_all":
            self.policy = uniform_policy(m, "compress", b)
        elif n == "adacc_all_no_outlier":
            codec, params = NO_OUTLIER_CODEC
            swap = {t: codec for t, c in CODEC_FOR_LAYER.items() if c == "int4_outlier"}
            self.policy = uniform_policy(
                m, "compress", b, codecs=swap, codec_params={codec: params}
            )
        elif n in BUDGETED:
            self._prepare_adacc()
        return self

    def _prepare_adacc(self) -> None:
        if self.profiles is None or (
            self.name == "adacc_no_outlier" and self.profiles.no_outlier is None
        ):
            self.profiles = profile_for(
                self.model,
                self.batch,
                self.profile_repeats,
                no_outlier=self.name == "adacc_no_outlier",
            )
        prof = self.profiles.no_outlier if self.name == "adacc_no_outlier" else self.profiles.adacc
        cfg = AdaccConfig(
            budget=int(self.budget_nbytes),
            adaptive=self.name == "adacc_adaptive",
            profile_repeats=self.profile_repeats,
        )
        session = AdaccSession(self.model, cfg, profile=copy.deepcopy(prof))
        session.static_nbytes = self.static_nbytes
        try:
            policy = session.solve(session.profile)
        except BudgetError as e:
            self.fits_budget = False
            self.info["error"] = str(e).split(". ")[0]
            return
        self.info.update(
            profile_s=self.profiles.profile_s,
            solve_ms=float(policy.metadata.get("solve_ms", float("nan"))),
            solver_status=policy.metadata.get("status"),
            predicted=policy.metadata.get("predicted", {}),
            summary=policy.summary(),
        )
        if self.name == "adacc_adaptive":
            session.policy = None  # `setup` solves again from the given profile on first entry
            self.session = session
        else:
            self.policy = policy

    # ------------------------------------------------------------------- enter / leave
    def __enter__(self) -> Strategy:
        if not self.fits_budget:
            raise BudgetError(f"{self.name}: no policy fits the budget ({self.info.get('error')})")
        self.prepare()
        if self._before is not None:
            raise RuntimeError(f"strategy {self.name} is already entered")
        self._before = patch_state(self.model)
        self._saved = _snapshot_attrs(self.model)
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        return self

    def _install(self) -> None:
        n = self.name
        if n in ("hf_full", "hf_offload"):
            _hf_enable(self.model, offload=n == "hf_offload")
        elif n == "adacc_adaptive":
            assert self.session is not None
            if not self._entered_once:
                self.session.setup(self.batch)  # solves from the shared profile: no profiling
                self.session.on_step_begin(1)
                self._step = 0
            else:
                self.session.apply(self.session.policy)
                if self.session._tracker is not None:  # a tracking step was under way
                    self.session.handle.set_tracker(self.session._tracker)
        elif self.policy is not None:
            self._handle = apply_adacc(self.model, self.policy)
        self._entered_once = True

    def _uninstall(self) -> None:
        n = self.name
        if n in ("hf_full", "hf_offload"):
            _hf_disable(self.model)
        if self.session is not None:
            self.session.close()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __exit__(self, *exc: object) -> None:
        try:
            self._uninstall()
        finally:
            assert self._saved is not None and self._before is not None
            _restore_attrs(self.model, self._saved)
            before, self._before, self._saved = self._before, None, None
        after = patch_state(self.model)
        if after != before:
            diff = [k for k in before if before[k] != after.get(k)][:5]
            raise PatchLeftError(f"strategy {self.name} left the model patched at {diff}")

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context around one training step's forward and backward."""
        return contextlib.nullcontext()

    def after_step(self) -> None:
        """Call after each optimizer step: Adacc with evolution tracks, re-solves and switches."""
        self._step += 1
        if self.session is not None and self.session.active:
            event = self.session.step_done(self._step)
            if event is not None and event.kind == "switch":
                self.info.setdefault("switches", []).append(event.step)
            self.info["tracking_steps"] = list(self.session.schedule.history)

    @property
    def active_policy(self) -> Policy | None:
        if self.session is not None:
            return self.session.policy
        return self.policy


def build(
    names: list[str],
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    budget_nbytes: int | None,
    static_nbytes: int,
    profiles: Profiles | None = None,
    profile_repeats: int = 3,
) -> dict[str, Strategy]:
    """Prepare `names` for one model, batch and budget, profiling once for all Adacc strategies."""
    want_adacc = [n for n in names if n in BUDGETED]
    if want_adacc and profiles is None:
        profiles = profile_for(
            model, batch, profile_repeats, no_outlier="adacc_no_outlier" in want_adacc
        )
    out = {}
    for n in names:
        s = Strategy(
            n,
            model,
            batch,
            budget_nbytes=budget_nbytes,
            static_nbytes=static_nbytes,
            profiles=profiles,
            profile_repeats=profile_repeats,
        )
        out[n] = s.prepare()
    return out


# --------------------------------------------------------------------------------- stepping
def loss_of(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, Mapping) else out[0]


def train_step(
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy | None = None,
    *,
    clip: float | None = None,
) -> float:
    """Forward, backward and optimizer step; returns the loss."""
    ctx = strategy.step_context() if strategy is not None else contextlib.nullcontext()
    with ctx:
        loss = loss_of(model(**batch))
        loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if strategy is not None:
        strategy.after_step()
    return float(loss.detach())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    strategies: Mapping[str, Strategy],
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    *,
    rounds: int = 3,
    steps: int = 2,
    warmup: int = 1,
    errors: tuple[type[BaseException], ...] = (),
    on_error: Callable[[str, BaseException], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per training step of each strategy, measured round-robin.

    Each round enters every strategy in turn (the order rotates from round to round), runs
    `warmup` untimed steps, then `steps` timed ones. Returns every timed step per strategy. A
    strategy whose step raises one of `errors` (out of memory) is dropped from later rounds.
    """
    device = next(model.parameters()).device
    names = list(strategies)
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: set[str] = set()
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            s = strategies[n]
            if not s.fits_budget or n in failed:
                continue
            try:
                with s:
                    for i in range(warmup + steps):
                        _sync(device)
                        t0 = time.perf_counter()
                        train_step(model, batch, optimizer, s)
                        _sync(device)
                        if i >= warmup:
                            times[n].append(time.perf_counter() - t0)
            except errors as e:
                failed.add(n)
                times[n] = []
                optimizer.zero_grad(set_to_none=True)
                if on_error is not None:
                    on_error(n, e)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------------- memory
class _LivePeak(TorchDispatchMode):
    """Highest sum of live storages created by aten ops, checked after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]
        if is_keyed(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    key = s.data_ptr()
                    if s.nbytes() and key not in self.live:
                        self.live[key] = (StorageWeakRef(s), s.nbytes())
                        self.current += s.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def cpu_step_peak_nbytes(
    model: nn.Module, batch: Mapping[str, Any], strategy: Strategy | None = None
) -> int:
    """Peak bytes of the storages a forward + backward creates (gradients included: they start
    as None, as after ``zero_grad(set_to_none=True)``). Works on any device: the CPU stand-in for
    ``torch.cuda.max_memory_allocated`` minus parameters and optimizer states. Kernel workspaces
    are not seen."""
    model.zero_grad(set_to_none=True)
    ctx = strategy.step_context() if strategy is not None else contextlib.nullcontext()
    tracker = _LivePeak()
    with ctx, tracker:
        loss = loss_of(model(**batch))
        loss.backward()
        del loss
    peak = tracker.peak
    model.zero_grad(set_to_none=True)
    return peak


def cuda_step_peak_nbytes(
    model: nn.Module, batch: Mapping[str, Any], optimizer: torch.optim.Optimizer | None
) -> int:
    """``torch.cuda.max_memory_allocated`` over one whole training step."""
    from adacc_hf import peak_step_memory

    return peak_step_memory(model, batch, optimizer)


def held_nbytes(
    model: nn.Module, batch: Mapping[str, Any], strategy: Strategy | None = None
) -> int:
    """Bytes a forward leaves for backward (`adacc_hf.activation_memory_report`)."""
    ctx = strategy.step_context() if strategy is not None else contextlib.nullcontext()
    with ctx:
        return activation_memory_report(model, batch).total


@contextlib.contextmanager
def entered(strategy: Strategy | None) -> Iterator[Strategy | None]:
    if strategy is None:
        yield None
        return
    with strategy:
        yield strategy
