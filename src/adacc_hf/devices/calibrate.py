"""Fitting a device table's efficiencies on step times a GPU measured, and checking them.

A committed run (`Run`) is one way of training one model on one batch that a GPU timed and
metered: no checkpointing, transformers' full checkpointing, or an Adacc plan at a budget.
`simulate` runs each on paper (`plan.plan_for_device`: the same profile, solve and dry step) and
records the step's ops (`dryrun.DryRun.trace`); `fit` then searches the efficiencies that bring
the recorded steps (`dryrun.replay`, milliseconds per try) closest to the measured times, in
log-ratio, held near the table's prior (`DeviceTable.prior`: what the device measured of itself,
else `table.DEFAULT_EFFICIENCY`) by a weak pull, within physical bounds. Plans
depend on the efficiencies (the solver weighs recompute against keeping by its times), so a
check re-simulates with the fitted table before it compares (`check`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime import timing
from .dryrun import replay
from .table import DEFAULT_EFFICIENCY, DeviceTable

__all__ = ["BOUNDS", "Outcome", "Run", "Setting", "check", "fit", "simulate"]

#: The range each efficiency may be fitted in (what the hardware makes physical).
BOUNDS: dict[str, tuple[float, float]] = {
    "matmul": (0.3, 0.95),
    "attention": (0.15, 0.9),
    "memory": (0.4, 1.0),
    "launch_us": (1.0, 12.0),
    "host_op_us": (2.0, 40.0),
    "host_mode_us": (5.0, 150.0),
}
PRIOR = 0.01  # weight of the pull toward the defaults, per log-ratio squared


@dataclass(frozen=True)
class Setting:
    """A model (a transformers config's fields) and the micro-batch a GPU trained it on."""

    name: str
    model_type: str
    config: tuple[tuple[str, Any], ...]
    batch_size: int
    seq_len: int
    optimizer: str = "adamw_torch_fused"

    def build(self) -> tuple[Any, dict]:
        import transformers

        from .plan import empty_model, random_batch

        config = transformers.AutoConfig.for_model(
            self.model_type, **dict(self.config), use_cache=False
        )
        model = empty_model(config)
        return model, random_batch(config, self.batch_size, self.seq_len)


@dataclass
class Run:
    """One committed measurement: `strategy` (``none``, ``hf_full``, ``adacc``) on `setting`,
    with the Adacc plan's budget, head and offload; the step time (None: not timed) and the
    allocated peak (None: not metered) the GPU measured."""

    name: str
    device: str
    setting: Setting
    strategy: str
    step_ms: float | None
    peak_nbytes: int | None
    budget_nbytes: int | None = None
    head: str = "full"
    offload: bool | None = None
    # the chunked head's chunk size on a GPU when the run was measured, where it was not today's
    # (`runtime.head_loss.GPU_CHUNK_LOGITS_NBYTES`): a run is simulated as the code ran it
    gpu_chunk_nbytes: int | None = None
    # the profiler timed blocks synchronised, one run alone (`runtime.timing.synchronised`), not
    # among blocks as it does today: the plan is made again as the run's code made it
    synchronised_blocks: bool = False


@dataclass
class Outcome:
    """A run simulated on paper."""

    run: Run
    step_ms: float
    peak_nbytes: int
    predicted_peak_nbytes: int | None = None  # the plan's prediction (Adacc)
    predicted_step_ms: float | None = None  # no checkpointing's step + the plan's added time
    summary: dict = field(default_factory=dict)
    trace: list = field(default_factory=list)

    def errors(self) -> dict[str, float]:
        """Relative errors against the GPU's figures (time and allocated peak)."""
        out = {}
        if self.run.step_ms:
            out["step_ms"] = self.step_ms / self.run.step_ms - 1
        if self.run.peak_nbytes:
            peak = self.predicted_peak_nbytes or self.peak_nbytes
            out["peak_nbytes"] = peak / self.run.peak_nbytes - 1
        return out


def simulate(runs: Sequence[Run], table: DeviceTable) -> list[Outcome]:
    """Every run on paper on `table`'s device (runs of one setting share its model)."""
    from .plan import plan_for_device

    out: list[Outcome] = []
    by_setting: dict[Setting, list[Run]] = {}
    for r in runs:
        by_setting.setdefault(r.setting, []).append(r)
    for setting, rs in by_setting.items():
        model, batch = setting.build()
        base = [r for r in rs if r.strategy in ("none", "hf_full")]
        if base:
            plan = plan_for_device(
                model,
                batch,
                table,
                optimizer=setting.optimizer,
                steps=tuple(sorted({r.strategy for r in base})),
                solve=False,
            )
            for r in base:
                s = plan.steps[r.strategy]
                out.append(Outcome(r, s.step_ms, s.peak_nbytes, trace=s.trace))
        for r in (r for r in rs if r.strategy == "adacc"):
            with _chunks(r.gpu_chunk_nbytes), timing.synchronised(r.synchronised_blocks):
                plan = plan_for_device(
                    model,
                    batch,
                    table,
                    budget=r.budget_nbytes,
                    optimizer=setting.optimizer,
                    head=r.head,
                    offload=r.offload,
                    steps=("none", "adacc"),
                    fit_reserved=False,  # the GPU runs planned allocated bytes
                )
            s = plan.steps["adacc"]
            summary = plan.policy.summary() if plan.policy is not None else {}
            out.append(
                Outcome(
                    r,
                    s.step_ms,
                    s.peak_nbytes,
                    plan.predicted_peak_nbytes,
                    plan.predicted_step_ms,
                    summary,
                    s.trace,
                )
            )
    return out


@contextlib.contextmanager
def _chunks(nbytes: int | None) -> Iterator[None]:
    """The chunked head's GPU chunk size set to `nbytes` inside (None: as it is)."""
    from ..runtime import head_loss

    was = head_loss.GPU_CHUNK_LOGITS_NBYTES
    if nbytes is not None:
        head_loss.GPU_CHUNK_LOGITS_NBYTES = nbytes
    try:
        yield
    finally:
        head_loss.GPU_CHUNK_LOGITS_NBYTES = was


def _loss(
    params: dict[str, float], outcomes: Iterable[Outcome], table: DeviceTable
) -> tuple[float, float]:
    """(the fit's objective, the largest relative time error) of `params`."""
    total, worst = 0.0, 0.0
    for o in outcomes:
        ms = replay(o.trace, table, params) * 1e3
        r = math.log(ms / o.run.step_ms)
        total += r * r
        worst = max(worst, abs(ms / o.run.step_ms - 1))
    prior = {**DEFAULT_EFFICIENCY, **table.prior}
    total += PRIOR * sum(math.log(params[k] / prior[k]) ** 2 for k in params)
    return total, worst


def fit(
    table: DeviceTable, outcomes: Sequence[Outcome], iterations: int = 400
) -> tuple[dict[str, float], float]:
    """The efficiencies that best explain the timed `outcomes` (simulated on `table`), and the
    largest relative time error they leave among them (Nelder-Mead in log space, `BOUNDS`)."""
    timed = [o for o in outcomes if o.run.step_ms and o.trace]
    if not timed:
        return dict(table.efficiency), float("nan")
    keys = sorted(BOUNDS)

    def params_of(v: Sequence[float]) -> dict[str, float]:
        lo_hi = [BOUNDS[k] for k in keys]
        pairs = zip(keys, v, lo_hi, strict=True)
        return {k: min(max(math.exp(x), lo), hi) for k, x, (lo, hi) in pairs}

    def objective(v: Sequence[float]) -> float:
        return _loss(params_of(v), timed, table)[0]

    start = [math.log(table.efficiency.get(k, DEFAULT_EFFICIENCY[k])) for k in keys]
    best = _nelder_mead(objective, start, iterations)
    params = params_of(best)
    return params, _loss(params, timed, table)[1]


def _nelder_mead(
    f: Callable[[Sequence[float]], float], x0: Sequence[float], iterations: int, step: float = 0.3
) -> list[float]:
    """Minimise `f` from `x0` (the textbook simplex; a handful of parameters)."""
    n = len(x0)
    simplex = [list(x0)] + [
        [x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)
    ]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float, c0: list[float] = centroid, w0: list[float] = worst) -> list[float]:
            return [c + t * (w - c) for c, w in zip(c0, w0, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]
                ]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def check(runs: Sequence[Run], table: DeviceTable) -> list[Outcome]:
    """`runs` simulated on `table` (its efficiencies as they are: fitted on other runs)."""
    return simulate(runs, table)
