"""One model's throughput suite: every strategy on the same model, micro-batch and budget.

1. The budget, from Adacc's profile at the main micro-batch: ``lo + f (hi - lo)`` between the
   smallest budget any policy fits in and what no checkpointing needs (`adacc.budget_range`).
2. Batch-size sweep at that budget: per batch size, every strategy's memory (`memory.step_memory`)
   and its step time, round-robin (`steps.time_interleaved`); ratios to HF full checkpointing from
   the same run; the cost model's prediction beside the measurement; Adacc against the best
   baseline that fits and every prediction against its measurement round by round, with
   intervals and verdicts (`stats`).
3. Memory suffices: at a budget above no checkpointing's need, Adacc against no checkpointing.
4. The largest micro-batch that fits the budget, per strategy (`search.largest`).

`bench_model` fills one model's entry of the results JSON (see ``bench_throughput.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adacc_hf import Policy, estimate_static_memory, get_adapter, uniform_policy
from adacc_hf.errors import BudgetError
from adacc_hf.solver import StaticMemory, predict, solve

from .adacc import Profiles, budget_range, profile_for
from .env import Deadline, default_dtype
from .memory import fits, free_cached, oom_errors, step_memory
from .models import ModelSpec
from .prepared import Prepared
from .report import MiB, jsonable, main_row, print_rows
from .search import largest, resolve_searched
from .stats import added_times, vs_best_fitting
from .steps import median, step_stats, time_interleaved
from .strategies import MAIN, SEARCHED, build, prepare


@dataclass
class Run:
    """One model under benchmark: its optimizer, static memory and the suite's settings."""

    spec: ModelSpec
    model: torch.nn.Module
    static: StaticMemory
    optimizer: torch.optim.Optimizer
    args: argparse.Namespace
    deadline: Deadline
    memo: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return next(self.model.parameters()).device.type == "cuda"

    def batch(self, bs: int) -> dict[str, Any]:
        return self.spec.batch(self.model, bs)

    @property
    def static_nbytes(self) -> int:
        return self.static.total

    def memory(self, strategy: Prepared, batch: dict[str, Any]) -> dict[str, Any]:
        return step_memory(strategy, batch, self.optimizer)

    def fits(self, mem: dict[str, Any], budget: int, rule: str = "peak") -> bool:
        return fits(mem, budget, self.static_nbytes, rule)


def solve_ms(profile, budget: int, static: StaticMemory, n: int = 5) -> float | None:
    """Median MILP solve time of `n` solves (None when no policy fits)."""
    try:
        return median([solve(profile, budget, static_nbytes=static).solve_ms for _ in range(n)])
    except BudgetError:
        return None


def bench_batch(
    run: Run, names: list[str], bs: int, budget: int, *, baseline: str = "hf_full"
) -> tuple[dict[str, Any], dict[str, Prepared]]:
    """Memory and step time of `names` at micro-batch `bs` under `budget`: the row and the
    prepared strategies. A `strategies.SEARCHED` name runs as what `resolve_searched` picks
    (keyed by that pick; its row says which name it was searched for)."""
    batch = run.batch(bs)
    a = run.args
    t0 = time.perf_counter()
    layers = len(get_adapter(run.model).find_blocks(run.model))

    def fits(name: str) -> bool:  # a candidate's measured step peak within the budget
        s = prepare(name, run.model, batch, budget_nbytes=budget, static_nbytes=run.static)
        return run.fits(run.memory(s.prepare(), batch), budget)

    searched = {resolve_searched(n, fits, layers): n for n in names if n in SEARCHED}
    names = [n for n in names if n not in SEARCHED]
    names += [n for n in searched if n not in names]
    ready = build(
        names,
        run.model,
        batch,
        budget_nbytes=budget,
        static_nbytes=run.static,
        profile_repeats=a.profile_repeats,
    )
    build_s = time.perf_counter() - t0
    rows: dict[str, dict[str, Any]] = {}
    for n, s in ready.items():
        rows[n] = {"label": s.label, "info": jsonable(s.info)}
        if n in searched:
            rows[n]["searched_as"] = searched[n]
        if s.fits_budget:
            rows[n].update(run.memory(s, batch))
            rows[n]["fits"] = run.fits(rows[n], budget)
        else:
            rows[n].update(fits=False, infeasible=True)
    runnable = {n: s for n, s in ready.items() if s.fits_budget and not rows[n].get("oom")}

    def dropped(name: str, err: BaseException) -> None:
        rows[name]["oom_in_timing"] = True
        free_cached()

    cpu: dict[str, list[float]] = {}
    times = time_interleaved(
        runnable,
        run.model,
        batch,
        run.optimizer,
        rounds=a.rounds,
        steps=a.steps,
        warmup=a.warmup,
        errors=oom_errors(),
        on_error=dropped,
        cpu=None if run.cuda else cpu,
    )
    for n, ts in times.items():
        rows[n].update(step_stats(ts, bs * run.spec.seq_len))
        if cpu.get(n):
            rows[n]["cpu_ms_median"] = median(cpu[n]) * 1e3
            rows[n]["cpu_ms_min"] = min(cpu[n]) * 1e3
            rows[n]["cpu_ms_all"] = [t * 1e3 for t in cpu[n]]
        rows[n]["info"] = jsonable(ready[n].info)
    add_predictions(run, ready, rows, batch)
    added_times(rows, a.steps)
    vs_best_fitting(rows, a.steps)
    base = rows.get(baseline, {})
    for r in rows.values():
        for key, ratio in (("tokens_per_s", "ratio"), ("tokens_per_s_best", "ratio_best")):
            r[f"{ratio}_vs_{baseline}"] = r.get(key, float("nan")) / base.get(key, float("nan"))
    return {
        "batch_size": bs,
        "budget_nbytes": budget,
        "build_s": build_s,
        "strategies": rows,
    }, ready


def add_predictions(
    run: Run, ready: dict[str, Prepared], rows: dict[str, Any], batch: dict[str, Any]
) -> None:
    """The cost model's held bytes, peak and added time of each strategy's policy (from Adacc's
    profile at this batch, with what a session measured of its own policy; a strategy without one
    as the uniform policy it amounts to), beside the measured ones."""
    prof = next((s.profiles.adacc for s in ready.values() if s.profiles is not None), None)
    if prof is None:
        return
    uniform: dict[str, Policy] = {}
    for n, s in ready.items():
        pol, action = s.policy, s.uniform_equivalent
        if pol is None and action is not None:
            if action not in uniform:
                uniform[action] = uniform_policy(run.model, action, batch)
            pol = uniform[action]
        if pol is None:
            continue
        session = getattr(s, "session", None)  # Adacc's: its tables measured on its own copy
        own = session.current.profile if session is not None and session.current else None
        pred = predict(own or prof, pol, run.static)
        rows[n]["predicted_held_nbytes"] = pred.held_nbytes
        rows[n]["predicted_peak_nbytes"] = pred.peak_nbytes
        if pred.unprofiled:  # codecs the profile sized but never timed: no time to predict
            rows[n]["unprofiled_codec_ops"] = len(pred.unprofiled)
        else:
            rows[n]["predicted_added_ms"] = pred.added_ms


def max_batch(run: Run, name: str, budget: int, rules: tuple[str, ...]) -> dict[str, int]:
    """Largest micro-batch of strategy `name` that fits `budget` under each rule."""

    def mem(bs: int) -> dict[str, Any]:
        key = (name, bs)
        if key not in run.memo:
            batch = run.batch(bs)
            s = prepare(
                name,
                run.model,
                batch,
                budget_nbytes=budget,
                static_nbytes=run.static,
                profile_repeats=1,
            )
            try:
                s.prepare()
                run.memo[key] = run.memory(s, batch) if s.fits_budget else {"oom": True}
            except oom_errors():
                run.memo[key] = {"oom": True}
                free_cached()
        return run.memo[key]

    cap = run.spec.max_batch_cap
    return {
        rule: largest(lambda b, rule=rule: run.fits(mem(b), budget, rule), cap) for rule in rules
    }


def bench_model(
    spec: ModelSpec,
    args: argparse.Namespace,
    deadline: Deadline,
    out: dict[str, Any],
    save: Callable[[], None],
) -> dict[str, Any]:
    """Fill ``out["models"][spec.name]`` (see the module docstring); `save` writes `out` as it
    stands."""
    device = torch.device(args.device)
    dtype = default_dtype(device, args.dtype)
    model, weights = spec.build(device, dtype)
    fused = device.type == "cuda"  # no foreach temporaries
    est = estimate_static_memory(model, optimizer="adamw_torch_fused" if fused else "adamw_torch")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **({"fused": True} if fused else {}))
    run = Run(spec, model, est, opt, args, deadline)
    names = [n for n in args.strategies if n in MAIN or n in SEARCHED]
    res: dict[str, Any] = {
        "seq_len": spec.seq_len,
        "config": spec.config,
        "weights": weights,
        "dtype": str(dtype),
        "num_params": sum(p.numel() for p in model.parameters()),
        "static_nbytes": run.static_nbytes,
        "strategies": names,
    }
    out["models"][spec.name] = res
    batch_sizes = args.batch_sizes or list(spec.batch_sizes)
    main_bs = spec.main_batch if spec.main_batch in batch_sizes else batch_sizes[-1]
    profiles, hi = _budget(run, res, main_bs)
    _sweep(run, res, names, batch_sizes, profiles.profile_s, save)
    if not deadline.passed() and {"none", "adacc"} <= set(names):
        _ample(run, res, names, hi)
        save()
    if not args.skip_max_batch:
        _max_batches(run, res, names, save)
    del model, opt, run
    free_cached()
    return res


def _budget(run: Run, res: dict[str, Any], main_bs: int) -> tuple[Profiles, int]:
    """Phase 1: the budget, from the profile at the main micro-batch."""
    a, spec = run.args, run.spec
    profiles = profile_for(run.model, spec.batch(run.model, main_bs), a.profile_repeats)
    lo, hi = budget_range(profiles.adacc, run.static)
    budget = a.budget_nbytes or int(lo + a.budget_fraction * (hi - lo))
    res.update(
        main_batch=main_bs,
        min_budget_nbytes=lo,
        no_checkpoint_need_nbytes=hi,
        budget_nbytes=budget,
        budget_fraction=None if a.budget_nbytes else a.budget_fraction,
        profile_s=profiles.profile_s,
        solve_ms_median=solve_ms(profiles.adacc, budget, run.static),
    )
    print(
        f"[{spec.name}] {res['num_params'] / 1e6:.1f}M params, {res['weights']}; static "
        f"{run.static_nbytes / MiB:.1f} MiB; smallest budget {lo / MiB:.1f} MiB, no checkpointing "
        f"needs {hi / MiB:.1f} MiB; budget {budget / MiB:.1f} MiB; profile "
        f"{profiles.profile_s:.1f} s, solve {res['solve_ms_median']} ms",
        flush=True,
    )
    return profiles, hi


def _sweep(
    run: Run,
    res: dict[str, Any],
    names: list[str],
    batch_sizes: list[int],
    profile_s: float,
    save: Callable[[], None],
) -> None:
    """Phase 2: every batch size at the budget; Adacc's policy at the main batch saved (and
    drawn), and profiling time in Adacc steps."""
    spec, budget = run.spec, res["budget_nbytes"]
    res["sweep"], steps_equiv = [], None
    for bs in batch_sizes:
        if run.deadline.passed():
            res["truncated"] = f"time limit reached before batch {bs}"
            break
        print(f"[{spec.name}] batch {bs} ({run.deadline})", flush=True)
        row, ready = bench_batch(run, names, bs, budget)
        res["sweep"].append(jsonable(row))
        print_rows(spec.name, bs, row["strategies"])
        adacc = ready.get("adacc")
        if bs == res["main_batch"] and adacc is not None and adacc.policy is not None:
            _save_policy(run, res, adacc, bs)
            adacc_ms = row["strategies"]["adacc"].get("step_ms_median")
            res["plan_s"] = plan_s = float(adacc.info.get("plan_s", 0.0))
            if adacc_ms:
                steps_equiv = (profile_s + plan_s) * 1e3 / adacc_ms
        save()
    res["profile_steps_equiv"] = steps_equiv


def _save_policy(run: Run, res: dict[str, Any], adacc: Prepared, bs: int) -> None:
    a, spec = run.args, run.spec
    stem = f"policy-{spec.name}-{a.tag}"
    adacc.policy.save(str(Path(a.results) / f"{stem}.json"))
    res["policy_json"] = f"{stem}.json"
    if not a.no_plots:
        from .policy_picture import draw_policy

        title = (
            f"{spec.name}: Adacc policy at batch {bs} x {spec.seq_len}, budget "
            f"{res['budget_nbytes'] / MiB:.0f} MiB"
        )
        draw_policy(adacc.policy, str(Path(a.results) / f"{stem}.png"), title)
        res["policy_png"] = f"{stem}.png"


def _ample(run: Run, res: dict[str, Any], names: list[str], hi: int) -> None:
    """Phase 3: memory suffices: Adacc against no checkpointing at the main batch."""
    none_peak = ((main_row(res) or {}).get("strategies", {}).get("none", {})).get("peak_nbytes")
    ample = int(max(hi, none_peak or 0) * 1.05)
    which = [n for n in ("none", "adacc", "adacc_adaptive") if n in names]
    row, _ = bench_batch(run, which, res["main_batch"], ample, baseline="none")
    res["ample"] = jsonable(row)
    print_rows(run.spec.name + " ample", res["main_batch"], row["strategies"], baseline="none")


def _max_batches(run: Run, res: dict[str, Any], names: list[str], save: Callable[[], None]) -> None:
    """Phase 4: the largest micro-batch under the budget, per strategy."""
    budget, rules = res["budget_nbytes"], tuple(run.args.max_batch_rules)
    # the sweep already measured its batch sizes under this budget
    run.memo.update(
        ((n, row["batch_size"]), r)
        for row in res["sweep"]
        for n, r in row["strategies"].items()
        if r.get("peak_nbytes") is not None or r.get("oom") or r.get("infeasible")
    )
    same = {"adacc_adaptive": ("adacc", "same first policy")}
    # checkpointing every k-th layer holds more than every layer: the largest batch is every one's
    note = "same as {}: every k >= 2 holds more than checkpointing every layer"
    same |= {
        n: (fallback, note.format(fallback))
        for n, (_, fallback) in SEARCHED.items()
        if n != "compile_budget"
    }
    if not run.cuda:
        note = "same as hf_full: on a CPU there is no device memory to offload from"
        same["hf_offload"] = ("hf_full", note)
    res["max_batch"] = _max_batches_at(run, res, names, budget, rules, same)
    # More budgets (``--max-batch-fractions``): fresh measurements, keyed by budget.
    lo, hi = res["min_budget_nbytes"], res["no_checkpoint_need_nbytes"]
    by_budget = res["max_batch_by_budget"] = {str(budget): res["max_batch"]}
    evaluations = 0
    for f in run.args.max_batch_fractions:
        other = int(lo + f * (hi - lo))
        evaluations += len(run.memo)
        run.memo.clear()
        by_budget[str(other)] = _max_batches_at(run, res, names, other, rules, same)
        save()
    res["max_batch_evaluations"] = evaluations + len(run.memo)
    save()


def _max_batches_at(
    run: Run,
    res: dict[str, Any],
    names: list[str],
    budget: int,
    rules: tuple[str, ...],
    same: dict[str, tuple[str, str]],
) -> dict[str, Any]:
    mb: dict[str, Any] = {}
    for n in names:
        if run.deadline.passed():
            res["truncated"] = f"time limit reached in the max-batch search before {n}"
            break
        if n == "compile_budget":
            mb[n] = {"note": "not searched: each micro-batch size compiles anew"}
            continue
        if n in same and (same[n][0] in mb or n in SEARCHED):
            src = same[n][0]
            mb[n] = {**(mb.get(src) or max_batch(run, src, budget, rules)), "note": same[n][1]}
            continue
        mb[n] = max_batch(run, n, budget, rules)
        print(
            f"[{run.spec.name}] budget {budget / MiB:.1f} MiB: largest micro-batch {n:18s} "
            f"{mb[n]} ({run.deadline})",
            flush=True,
        )
    return mb
