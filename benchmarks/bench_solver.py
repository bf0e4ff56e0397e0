"""Policy solver speed: median wall time of `adacc_hf.solver.solve` per model family.

Synthetic profiles shaped like each family's block (llama ~40 ops, gpt2 ~35, bert ~30, t5 in 4
groups), sized like real models at a real micro-batch, with op and codec times from a simple
roofline and +-3 % seeded noise (real measurements never tie exactly)::

    python benchmarks/bench_solver.py              # -> benchmarks/results/solver-cpu.json
    python benchmarks/bench_solver.py --real       # profiles of the tiny test models instead

Per family: 5 budgets spread between the smallest feasible one and the no-checkpoint need, 20
solves each (the whole `solve` call: LP build, CBC, policy); prints the median and mean. Target:
median <= 50 ms per family on a 2-core CPU (printed, not asserted).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from adacc_hf.runtime.timing import cpu_timer
from adacc_hf.schema import Profile
from adacc_hf.solver import solve
from benchmarks.harness.adacc import budget_range
from benchmarks.harness.env import command_line
from benchmarks.harness.report import write_json
from benchmarks.harness.synthetic import FAMILIES, synthetic_profile

TARGET_MS = 50.0
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def real_profile(family: str) -> Profile:
    from adacc_hf import assets
    from adacc_hf.profiler import profile_model

    model = assets.tiny_model(family)
    return profile_model(model, assets.tiny_batch(family, model))


def machine_info() -> dict:
    """The CPU, versions and load the timings were taken with."""
    import pulp
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pulp": pulp.__version__,
        "load_average_1min": os.getloadavg()[0],  # other work on the machine skews timings
    }


def bench(profile: Profile, repeats: int, solver: str) -> dict:
    """`repeats` whole `solve` calls at each of `FRACTIONS` of the budget range: wall ms."""
    lo, hi = budget_range(profile)
    rows, times = [], []
    for frac in FRACTIONS:
        budget = int(lo + frac * (hi - lo))
        ts, sol = [], None
        for _ in range(repeats):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sol, ms = cpu_timer(solve, (profile, budget), {"solver": solver})
            ts.append(ms)
        times += ts
        rows.append(
            {
                "budget_fraction": frac,
                "budget_nbytes": budget,
                "median_ms": statistics.median(ts),
                "mean_ms": statistics.fmean(ts),
                "status": sol.status,
                "solver": sol.solver,
                "added_ms": sol.added_ms,
                "checkpointed": sol.checkpointed,
                "variants": {k: len(g.variants) for k, g in sol.policy.groups.items()},
            }
        )
    return {
        "groups": {k: g.num_blocks for k, g in profile.groups.items()},
        "ops_per_block": {k: len(g.ops) for k, g in profile.groups.items()},
        "budgets": rows,
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "max_ms": max(times),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--real", action="store_true", help="profile the tiny test models instead")
    p.add_argument("--repeats", type=int, default=20, help="solves per budget")
    p.add_argument("--solver", choices=["cbc", "highs"], default="cbc")
    default_out = Path(__file__).parent / "results" / "solver-cpu.json"
    p.add_argument("--json", type=Path, default=default_out, help="output path")
    args = p.parse_args(argv)

    results = {}
    head = ("family", "groups", "ops", "median ms", "mean ms", "max ms")
    print("{:8s} {:>6s} {:>4s} {:>10s} {:>8s} {:>7s}".format(*head))
    for family in args.families:
        prof = real_profile(family) if args.real else synthetic_profile(family)
        r = bench(prof, args.repeats, args.solver)
        results[family] = r
        ops = max(r["ops_per_block"].values())
        flag = "ok" if r["median_ms"] <= TARGET_MS else f"over the {TARGET_MS:g} ms target"
        print(
            f"{family:8s} {len(r['groups']):6d} {ops:4d} {r['median_ms']:10.1f} "
            f"{r['mean_ms']:8.1f} {r['max_ms']:7.1f}  {flag}"
        )
        for b in r["budgets"]:
            print(
                f"    budget {b['budget_fraction']:.1f}: median {b['median_ms']:6.1f} ms, "
                f"{b['status']}, +{b['added_ms']:.2f} ms/step, checkpointed {b['checkpointed']}"
            )
    out = {
        "command": command_line(argv),
        "machine": machine_info(),
        "profiles": "real (tiny models)" if args.real else "synthetic",
        "repeats_per_budget": args.repeats,
        "target_median_ms": TARGET_MS,
        "families": results,
    }
    write_json(args.json, out, indent=2, sort_keys=True)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
