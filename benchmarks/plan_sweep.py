"""Budget sweep on the tiny family configs: predicted vs measured activation memory and time.

For each family, budgets from the smallest feasible one to the no-checkpointing need; each solved
policy is applied and its activation memory measured independently of the prediction.

    python benchmarks/plan_sweep.py --out benchmarks/results/plan-sweep-cpu.json
"""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adacc_hf import assets
from benchmarks.harness import env
from benchmarks.harness.report import write_json
from benchmarks.harness.sweep import budget_sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--points", type=int, default=6)
    args = p.parse_args(argv)
    rows = []
    print(
        f"{'family':7s} {'budget KiB':>10s} {'share KiB':>9s} {'pred KiB':>8s} {'meas KiB':>8s} "
        f"{'err':>6s} {'+ms':>7s} {'ckpt':>4s}  actions"
    )
    for family in assets.SUPPORTED_FAMILIES:
        model = assets.tiny_model(family)
        for r in budget_sweep(model, assets.tiny_batch(family, model), args.points):
            rows.append({"family": family, **asdict(r), "error": r.error})
            acts = ", ".join(f"{k} {v}" for k, v in sorted(r.actions.items()))
            print(
                f"{family:7s} {r.budget_nbytes / 1024:10.1f} {r.share_nbytes / 1024:9.1f} "
                f"{r.predicted_nbytes / 1024:8.1f} {r.measured_nbytes / 1024:8.1f} "
                f"{r.error:+6.1%} {r.added_ms:7.3f} {r.checkpointed_blocks:4d}  {acts}"
            )
    if args.out:
        out = {
            "command": env.command_line(argv),
            "device": "cpu",
            "machine": platform.platform(),
            "torch": torch.__version__,
            "rows": rows,
        }
        write_json(args.out, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
