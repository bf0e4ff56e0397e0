"""Budget sweep on the tiny family configs: the step peak each plan predicts against the one
measured, for fixed shapes and dynamic padding, in fp32 and under bf16 autocast.

For each family, budgets from full recomputation's step peak to no checkpointing's (for the
longest batch); every batch's training step is measured with `adacc_hf.measure_step_peak`,
independently of the prediction.

    python benchmarks/plan_sweep.py --out benchmarks/results/plan-sweep-cpu.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from adacc_hf import assets
from benchmarks.harness import env
from benchmarks.harness.report import write_json
from benchmarks.harness.sweep import budget_sweep

LAYERS = {"t5": {"num_layers": 4, "num_decoder_layers": 4}, "gpt2": {"n_layer": 4}}
SHAPES = {"fixed": [64, 64], "dynamic": [16, 64, 32, 128, 48]}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--points", type=int, default=4)
    p.add_argument("--families", nargs="+", default=list(assets.SUPPORTED_FAMILIES))
    args = p.parse_args(argv)
    rows = []
    print(
        f"{'family':7s} {'dtype':5s} {'shape':9s} {'budget KiB':>10s} {'pred KiB':>9s} "
        f"{'meas KiB':>9s} {'err':>7s} {'+ms':>8s}  moment"
    )
    for family in args.families:
        for dtype, autocast in DTYPES.items():
            for mode, lengths in SHAPES.items():

                def make(family=family):
                    return assets.tiny_model(family, **LAYERS.get(family, {"num_hidden_layers": 4}))

                model = make()
                batches = [
                    assets.tiny_batch(family, model, batch_size=4, seq_len=n, seed=i)
                    for i, n in enumerate(lengths)
                ]
                for r in budget_sweep(make, batches, args.points, autocast=autocast):
                    rows.append(
                        {
                            "family": family,
                            "dtype": dtype,
                            "shapes": mode,
                            **asdict(r),
                            "error": r.error,
                            "at_edge": r.at_edge,
                        }
                    )
                    print(
                        f"{family:7s} {dtype:5s} {'x'.join(map(str, r.shape)):9s} "
                        f"{r.budget_nbytes / 1024:10.1f} {r.predicted_nbytes / 1024:9.1f} "
                        f"{r.measured_nbytes / 1024:9.1f} {r.error:+7.2%} {r.added_ms:8.3f}  "
                        f"{r.moment}{'' if r.at_edge else ' (inside its bucket)'}"
                    )
    over = [r for r in rows if r["measured_nbytes"] > r["budget_nbytes"]]
    worst = max((abs(r["error"]) for r in rows if r["at_edge"]), default=0.0)
    print(
        f"\n{len(rows)} steps: {len(over)} over budget; worst error at a bucket's edge {worst:.2%}"
    )
    if args.out:
        write_json(args.out, {**env.header("plan-sweep", sys.argv, "cpu"), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
