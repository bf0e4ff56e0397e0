"""The plan a GPU gets, made on this machine: `plan_for_device`.

Everything runs as a dry run priced by the device's table (`dryrun`, `roofline`): the model is
built without initialising its weights, the profiler and the solver run as a session runs them
(the same code: memory is measured on the allocations the step makes, times read the modelled
clock), and three training steps are run dry, each on the modelled clock with its allocations
metered: no checkpointing, transformers' full checkpointing, and the Adacc plan. What it cannot
know without the device: codec errors (the values are not computed; the plan's gradient-error
bound is checked by the run that uses it) and anything that depends on the data.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..policy import Policy
from ..runtime import apply_adacc
from ..runtime.peak import measure_step_peak
from ..solver import estimate_static_memory
from ..solver.window import min_budget, no_checkpoint_budget
from .dryrun import DryRun, dry_run
from .host_model import empty_model
from .host_model import modelled_optimizer as _optimizer
from .host_model import train_step as _step
from .reserved import step_reserved
from .roofline import Roofline
from .table import DeviceTable, load_device

__all__ = ["DevicePlan", "StepModel", "empty_model", "plan_for_device", "random_batch"]


@dataclass
class StepModel:
    """One way of training, run dry on the modelled device."""

    label: str
    step_ms: float  # modelled wall time of one training step (forward, backward, optimizer)
    peak_nbytes: int  # allocated peak of the step, metered on its allocations
    host_ms: float = 0.0  # of it, the host's time issuing ops
    kernels: int = 0
    trace: list = field(default_factory=list, repr=False)  # its ops (`dryrun.replay`)
    # what CUDA's caching allocator would reserve at the step's highest (`reserved`)
    reserved_nbytes: int | None = None


@dataclass
class DevicePlan:
    """What `plan_for_device` returns."""

    device: str
    budget_nbytes: int
    window: tuple[int, int]  # (least budget any plan fits, what no checkpointing needs)
    policy: Policy | None
    predicted_peak_nbytes: int | None
    predicted_step_ms: float | None  # no checkpointing's step + the plan's predicted added time
    steps: dict[str, StepModel] = field(default_factory=dict)
    static_nbytes: int = 0
    profile: Any = None  # the profile the plan was solved on (`schema.Profile`)
    # kept free below the budget for what the allocator reserves above the allocated peak
    reserve_nbytes: int = 0

    def speedup(self, name: str = "adacc", over: str = "hf_full") -> float:
        """Step-time ratio ``over / name`` (above 1: `name` is faster)."""
        return self.steps[over].step_ms / self.steps[name].step_ms


def random_batch(config: Any, batch_size: int, seq_len: int, seed: int = 0) -> dict[str, Any]:
    """Token ids and labels of `batch_size` x `seq_len` (no padding), as a benchmark's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def model_step(
    mode: DryRun,
    label: str,
    model: nn.Module,
    batch: Mapping[str, Any],
    opt: Any,
    expandable: bool = True,
) -> StepModel:
    """One step of `model` as it is now, run dry on `mode`'s clock (a first step makes the
    optimizer's states), then its allocated peak metered as a GPU run measures it, and its
    reserved peak under CUDA's caching allocator (`expandable` segments or not) predicted."""
    _step(model, batch, opt)
    mode.synchronize()  # timed as a benchmark times it: synchronised before and after
    t0, k0 = mode.clock(), mode.kernels
    mode.trace = []
    try:
        _step(model, batch, opt)
    finally:
        trace, mode.trace = mode.trace, None
    host_ms = (mode.host_s - t0) * 1e3
    mode.synchronize()
    step = StepModel(label, (mode.clock() - t0) * 1e3, 0, host_ms, mode.kernels - k0, trace)
    step.peak_nbytes = measure_step_peak(model, batch, opt).peak_nbytes
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    step.reserved_nbytes = step_reserved(
        model, lambda: _step(model, batch, opt), opt, tensors, expandable=expandable
    ).reserved
    return step


def _full_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' own full activation checkpointing, non-reentrant (the name moved in 5.23)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    if enable is None:
        enable, disable = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
    if on:
        enable(**{_kwargs_name(enable): {"use_reentrant": False}})
    else:
        disable()


def _kwargs_name(fn: Any) -> str:
    import inspect

    names = inspect.signature(fn).parameters
    return next(n for n in names if n.endswith("checkpointing_kwargs"))


def plan_for_device(
    model: nn.Module,
    batch: Mapping[str, Any],
    device: str | DeviceTable,
    *,
    budget: int | None = None,
    fraction: float | None = None,
    optimizer: str = "adamw_torch_fused",
    head: str = "full",
    offload: bool | None = None,
    codecs: list[str] | None = None,
    codec_speed: float | None = None,
    steps: tuple[str, ...] = ("none", "hf_full", "adacc"),
    solve: bool = True,
    expandable: bool = True,
    fit_reserved: bool = True,
) -> DevicePlan:
    """Profile, solve and run `model`'s step on paper for `device` (a table's name, or a table).

    Args:
        model: A transformers model on the CPU (`empty_model`: weights need no values).
        batch: The micro-batch (`random_batch`).
        device: ``"h100"``, ``"h200"`` (`table.known_devices`) or a `DeviceTable`.
        budget: The per-device budget in bytes for the whole step's peak; or
        fraction: where in the budget window to plan (0: the least any plan fits, 1: what no
            checkpointing needs), as the GPU checks set their budgets.
        optimizer: The optimizer whose states are in the step (``adamw_torch_fused`` as the
            GPU runs step, ``adamw_torch``, ``sgd``).
        head: The LM head option (``"full"``, ``"chunked"``, ``"auto"``).
        offload: Plan offload over the table's host link (None: where the table has one).
        codecs: The codecs the solver may use (None: each layer type's own).
        codec_speed: Price every codec at this fraction of the device's copy bandwidth
            instead of its measured backends (what a faster codec would buy).
        steps: Which steps to run dry (``none``, ``hf_full``, ``adacc``).
        solve: Plan Adacc (profile and solve); False: the baseline steps alone.
        expandable: CUDA's allocator with expandable segments (what ``import adacc_hf`` sets
            where the user configured nothing) or its default. The plan's step is replayed
            through the allocator's model (`reserved`); where it would reserve more than the
            budget, the plan is solved again with what it reserved above its allocated peak
            kept free (until it fits, or only full recomputation is left).
        fit_reserved: solve again while the reserved peak passes the budget (above); False
            plans allocated bytes alone, as the committed GPU runs did (their reserved peak is
            still modelled).
    """
    from ..engine.config import AdaccConfig
    from ..engine.facts import RunFacts
    from ..engine.guard import MARGIN
    from ..engine.session import AdaccSession
    from ..profiler import profile_model

    table = load_device(device) if isinstance(device, str) else device
    roofline = Roofline(table, codec_speed)
    if offload is None:
        offload = bool(table.link)
    out: dict[str, StepModel] = {}
    opt = _optimizer(model, optimizer)
    with dry_run(roofline) as mode, torch.random.fork_rng(devices=[]):
        static = estimate_static_memory(model, optimizer=optimizer)
        if "none" in steps:
            out["none"] = model_step(mode, "no checkpointing", model, batch, opt, expandable)
        if "hf_full" in steps:
            _full_checkpointing(model, True)
            try:
                out["hf_full"] = model_step(
                    mode, "HF full checkpointing", model, batch, opt, expandable
                )
            finally:
                _full_checkpointing(model, False)
        if not solve:
            return DevicePlan(table.label, 0, (0, 0), None, None, None, out, static.total)
        probes: dict = {}
        cfg = AdaccConfig(
            budget=1,  # replaced below, once the window is known
            codecs=codecs,
            adaptive=False,
            head=head,
            offload=offload,
            profile_repeats=1,
            run=RunFacts(optimizer=optimizer),
        )
        profile = profile_model(
            model,
            batch,
            codecs=codecs,
            codec_params=cfg.compression.codec_params(),
            repeats=1,
            warmup=0,
            probes=probes,
            head=head,
        )
        lo, hi = min_budget(profile, static, head=head), no_checkpoint_budget(profile, static)
        if budget is None:
            budget = int(lo + (fraction if fraction is not None else 0.5) * (hi - lo))
        cfg.budget = int(budget)
        session = AdaccSession(model, cfg)
        session.static = static
        reserve = 0
        for _ in range(6):
            policy = session.solver.solve_measured(copy.deepcopy(profile), probes, reserve)
            if "adacc" not in steps:
                break
            with apply_adacc(model, policy, host_cap=None):
                step = out["adacc"] = model_step(mode, "Adacc", model, batch, opt, expandable)
            reserved = step.reserved_nbytes or 0
            if not fit_reserved or reserved <= budget or budget - reserve <= lo:
                break
            # keep free what the allocator reserves above this plan's allocated peak
            reserve = max(reserve + MARGIN, reserved - step.peak_nbytes + MARGIN)
        pred = policy.metadata.get("predicted", {})
        base = out.get("none")
        predicted_ms = None
        if base is not None and pred.get("added_ms") is not None:
            predicted_ms = base.step_ms + max(0.0, float(pred["added_ms"]))
    return DevicePlan(
        device=table.label,
        budget_nbytes=int(budget),
        window=(lo, hi),
        policy=policy,
        predicted_peak_nbytes=pred.get("peak_nbytes"),
        predicted_step_ms=predicted_ms,
        steps=out,
        static_nbytes=static.total,
        profile=profile,
        reserve_nbytes=reserve,
    )
