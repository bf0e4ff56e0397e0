"""Measured step peak minus predicted, with no headroom, across families and run settings (CPU).

For each family and setting (bf16 autocast or fp32, gradient accumulation 1 or 2, the model's own
LM head or the chunked one), a custom loop runs one optimizer step under a session planned with
``headroom=0`` at a budget between full recomputation's peak and no checkpointing's; the step is
then measured by the storage meter (`measure_step_peak`, the micro-batches distinct tensors as
the Trainer holds them). A positive ``measured - predicted`` is a step the solver would plan over
its budget. Settings the model cannot run (a head it cannot take) print why.

    python benchmarks/check_step_model.py [--families gpt2 llama ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from adacc_hf import measure_step_peak, prepare, profile_model
from adacc_hf.errors import AdaccError
from adacc_hf.solver import budget_between, estimate_static_memory
from adacc_hf.testing.families import FAMILIES, family_batch, family_model

DEFAULT = ["gpt2", "llama", "gemma2", "phi", "t5", "bert", "opt", "bloom", "bart", "qwen2_moe"]
#: (bf16 autocast, accumulation, head, budget fraction)
SETTINGS = [(True, 2, "full", 0.3), (True, 2, "chunked", 0.7), (True, 1, "full", 0.5),
            (False, 2, "full", 0.5), (False, 1, "chunked", 0.5)]  # fmt: skip


def one(family: str, bf16: bool, accumulation: int, head: str, fraction: float) -> dict:
    model = family_model(family).train()
    autocast = torch.bfloat16 if bf16 else None
    mp = "bf16" if bf16 else None
    static = estimate_static_memory(model, optimizer="adamw_torch", mixed_precision=mp)
    prof = profile_model(model, family_batch(model), repeats=1, autocast=autocast)
    budget = budget_between(prof, static, fraction, accumulation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    row = {"family": family, "bf16": bf16, "accumulation": accumulation, "head": head,
           "budget_nbytes": budget}  # fmt: skip
    session = prepare(
        model, budget, optimizer="adamw_torch", adaptive=False, head=head,
        gradient_accumulation_steps=accumulation, headroom=0.0,
    )  # fmt: skip
    try:
        micro = [family_batch(model) for _ in range(accumulation)]
        for b in micro:
            with amp:
                loss = model(**b).loss
            (loss / accumulation).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        predicted = session.policy.metadata["predicted"]["peak_nbytes"]
        peak = measure_step_peak(model, micro, opt, autocast=autocast).peak_nbytes
        row.update(predicted=predicted, measured=peak, over_prediction=peak - predicted)
    except AdaccError as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        session.close()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", default=DEFAULT)
    p.add_argument("--out", default=None, help="JSON of every row")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows, worst = [], None
    for fam in args.families:
        for bf16, acc, head, frac in SETTINGS:
            if head == "chunked" and FAMILIES[fam].kind != "causal":
                continue
            r = one(fam, bf16, acc, head, frac)
            rows.append(r)
            what = f"{fam:10s} {'bf16' if bf16 else 'fp32'} accumulation {acc} head {head:8s}"
            if "error" in r:
                print(f"{what} not run: {r['error']}", flush=True)
                continue
            worst = r["over_prediction"] if worst is None else max(worst, r["over_prediction"])
            print(f"{what} predicted {r['predicted']:>9,} measured - predicted "
                  f"{r['over_prediction']:>+8,} B", flush=True)  # fmt: skip
    run = sum("error" not in r for r in rows)
    print(f"{run} settings run; largest measured - predicted: {worst:+,} B")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1)
        )
    return 0 if worst is not None and worst <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
