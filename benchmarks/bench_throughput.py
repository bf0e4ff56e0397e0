"""Throughput and memory of every strategy on the same model, micro-batch and budget.

    python benchmarks/bench_throughput.py                 # CPU preset: 6-8 min, one thread
    python benchmarks/bench_throughput.py --preset gpu --models gpt2-117m   # one GPU part
    python benchmarks/bench_throughput.py --report benchmarks/results/throughput-cpu.json

Per model (`benchmarks.harness.throughput`): the budget ``lo + f (hi - lo)`` between the smallest
feasible one and what no checkpointing needs (``--budget-fraction``, default 0.4, so no
checkpointing does not fit; ``--budget-nbytes`` sets it directly); a batch-size sweep at that
budget, every strategy timed round-robin (``--rounds`` rounds, each in a new seeded order; in
each, per strategy: ``--warmup`` untimed steps, then ``--steps`` timed ones), tokens/s = batch x
sequence / median step time, each strategy's ratio to HF full checkpointing from the same run,
Adacc's ratio to the best baseline that fits and every added time against its prediction round by
round, with intervals and verdicts (`harness.stats`); a step is forward + backward + AdamW step;
memory held for backward and the step's peak; Adacc
against no checkpointing when memory suffices; the largest micro-batch that fits; Adacc's MILP
solve time (median of 5) and profiling time; the policy as a picture.

"Fits" and "peak": `adacc_hf.measure_step_peak` over a whole step (forward, backward, AdamW
step with its states present): the CUDA allocator's peak on a GPU (and no out-of-memory error),
every live storage on a CPU (`benchmarks.harness.memory`). ``--max-batch-rules peak held`` also
searches under the looser rule static + activations held after forward <= budget;
``--max-batch-fractions`` searches the largest micro-batch at more budgets than the main one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import env, report
from benchmarks.harness.models import PRESETS, find_specs
from benchmarks.harness.plots import throughput_plots
from benchmarks.harness.strategies import MAIN, SEARCHED, check_names, unavailable
from benchmarks.harness.throughput import bench_model

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--models", nargs="*", default=None, help="model names within the preset")
    p.add_argument("--strategies", nargs="*", default=[*MAIN, *SEARCHED])
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
        "--system-allocator",
        action="store_true",
        help="CPU: leave glibc malloc as it is (default: keep freed memory, as CUDA's allocator "
        "does; harness.env.cache_freed_memory)",
    )
    p.add_argument(
        "--max-batch-rules",
        nargs="+",
        choices=["peak", "held"],
        default=["peak"],
        help="'peak': step peak <= budget (and no OOM); 'held': static + activations held after "
        "forward <= budget (ignores backward temporaries; searches larger batches: slower)",
    )
    p.add_argument(
        "--max-batch-fractions",
        type=float,
        nargs="*",
        default=[],
        help="also search the largest micro-batch at these budgets (fractions between the least "
        "and no checkpointing, as --budget-fraction), e.g. 0.1 0.7",
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
    args.tag = args.tag or env.device_tag(args.device)
    args.out = args.out or str(Path(args.results) / f"throughput-{args.tag}.json")
    return args


def rules(cuda: bool) -> dict[str, str]:
    """What each measured field means (written into the results JSON)."""
    return {
        "tokens_per_s": "batch x seq / median step (forward + backward + AdamW) after warm-up",
        "tokens_per_s_best": "batch x seq / fastest step (noise on a shared machine only slows)",
        "peak_nbytes": "adacc_hf.measure_step_peak over a second step (forward, backward, AdamW "
        "step; optimizer states present): "
        + ("the CUDA allocator's peak" if cuda else "every live storage tracked on the CPU"),
        "fits": "peak_nbytes <= budget_nbytes (and no OOM)",
        "max_batch.peak": "largest micro-batch whose step peak fits (doubling, then bisection)",
        "max_batch.held": "static + activations held after forward <= budget (if searched)",
        "paired_added_ms": "per round, a strategy's median step over no checkpointing's in the same "
        "round; median and bootstrap interval over rounds, "
        + ("wall time" if cuda else "process CPU time (the profile's clock, one thread)"),
        "predicted_added_ms": "the cost model's added time over no checkpointing; Adacc's: the "
        "time of each action table its policy runs, measured on the profiled block (plan_s)",
        "plan_s": "Adacc's solves and the measuring and timing of its action tables, after "
        "profile_s",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            res = json.load(f)
        print(report.throughput_markdown(res))
        print(report.acceptance_markdown(res))
        return 0
    deadline = env.Deadline(args.time_limit)
    device = torch.device(args.device)
    env.set_threads(device, args.threads)
    allocator = env.cache_freed_memory(device, not args.system_allocator)
    check_names(args.strategies, (*MAIN, *SEARCHED))
    skipped = unavailable(args.strategies, device)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    args.strategies = [n for n in args.strategies if n not in skipped]
    specs = find_specs(args.preset, args.models)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    skip = ("results", "out", "report")
    out: dict[str, Any] = {
        **env.header("throughput", argv, device),
        "allocator": allocator,
        "settings": {k: v for k, v in vars(args).items() if k not in skip},
        "rules": rules(device.type == "cuda"),
        "skipped_strategies": skipped,
        "models": {},
    }

    def save() -> None:
        out["wall_s"] = deadline.elapsed()
        out["load_average_now"] = os.getloadavg()  # other jobs on the machine (1, 5, 15 min)
        out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        report.write_json(args.out, out)

    for spec in specs:
        bench_model(spec, args, deadline, out, save)
        save()
    if not args.no_plots:
        tag = Path(args.out).stem.removeprefix("throughput-")  # one set of plots per JSON
        out["plots"] = throughput_plots(out, Path(args.results), tag)
    save()
    print(f"wrote {args.out} in {out['wall_s']:.0f} s; plots: {out.get('plots', [])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
