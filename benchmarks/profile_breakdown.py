"""Where planning time goes, against the step it plans for (issue 32).

    python benchmarks/profile_breakdown.py [--runs full lora] [--fraction 0.5] [--device cuda]
        [--out benchmarks/results/profile-breakdown-cpu.json]

Real SmolLM2-135M (offline) on real Shakespeare text, AdamW, a custom loop under
`adacc_hf.prepare` (the Trainer's callback runs the same session):

* ``full``: a full fine-tune on one 4 x 256 batch;
* ``lora``: PEFT LoRA r 16 on every projection, 8 rows padded to 192, 64, 128 and 96 tokens, in
  that order (the first bucket is the longest, as `adacc_max_seq_len` plans it; the later ones
  are what dynamic padding brings).

Per bucket: the wall time of the step that planned it (profiling, solving and measuring the
policy's action tables, then the step itself), the session's per-phase breakdown
(`adacc_hf.profiler.phases`), and HF full checkpointing's step time on the same batch (median of
two after one warm-up) for the ratio the issue sets: first bucket ≤ 3 steps, later ones ≤ 0.5;
whether the bucket's memory was measured or interpolated (`adacc_hf.profiler.derive`), and the
step's real peak (`measure_step_peak`: on CPU every allocation of the allocator, on CUDA its
peak counter) against the prediction and the budget. On CUDA (``--device cuda``) the session also
checks each interpolated bucket's first step on the allocator's counter (`guard.DerivedCheck`):
``measured_after_check`` lists the buckets it sent to a full profile.

The budget is `--fraction` of the way from full recomputation's step peak to no
checkpointing's on the longest bucket. Each run is then started again on a fresh model from the
profiles the first saved (``profile_from``, as the Trainer reads its output directory): the
``again`` rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import (  # noqa: E402
    AdaccSession,
    estimate_static_memory,
    measure_step_peak,
    prepare,
    profile_model,
)
from adacc_hf.assets import shakespeare_text  # noqa: E402
from adacc_hf.integrations import write_artifacts  # noqa: E402
from adacc_hf.profiler.phases import format_phases  # noqa: E402
from adacc_hf.solver import budget_between  # noqa: E402
from benchmarks.bench_first_step import make_model  # noqa: E402
from benchmarks.harness import env  # noqa: E402
from benchmarks.harness.report import write_json  # noqa: E402

RUNS = {"full": (4, [256]), "lora": (8, [192, 64, 128, 96])}


def batches(tokenizer: Any, rows: int, lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Consecutive spans of the plays, `rows` x each length, each batch in storage of its own (as
    a collator's are: a view into the whole token run would keep every bucket's tokens alive in
    each step, which the measured peak counts and the plan, sized from the batch, does not)."""
    need = rows * sum(lengths)
    ids = tokenizer(shakespeare_text(need * 6), add_special_tokens=False, verbose=False)
    flat = torch.tensor(ids["input_ids"][:need])
    out, at = [], 0
    for n in lengths:
        x = flat[at : at + rows * n].view(rows, n).clone()
        at += rows * n
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    cuda = batch["input_ids"].is_cuda
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_step_s(model: torch.nn.Module, batch: dict) -> float:
    """HF full checkpointing's step on `batch`: median of two after a warm-up (fresh AdamW)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.gradient_checkpointing_enable()
    try:
        times = [step(model, opt, batch) for _ in range(3)][1:]
    finally:
        model.gradient_checkpointing_disable()
    return statistics.median(times)


def run(kind: str, fraction: float, saved: str, device: torch.device) -> dict[str, Any]:
    """The run, then the same run started again from the profiles the first saved in `saved`."""
    rows, lengths = RUNS[kind]
    model, tokenizer = make_model(kind)
    model.to(device)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(tokenizer, rows, lengths)]
    hf = [hf_step_s(model, b) for b in data]
    static = estimate_static_memory(model, optimizer="adamw_torch")
    budget = budget_between(profile_model(model, data[0], repeats=1), static, fraction)
    out: dict[str, Any] = {"kind": kind, "rows": rows, "budget_nbytes": budget}
    for name, source in (("first", None), ("again", saved)):
        if source is not None:
            model, _ = make_model(kind)
            model.to(device)
        out[name], session = planned(model, data, hf, budget, source, f"{kind} {name}")
        if source is None:
            write_artifacts(saved, session)
        session.close()
    return out


def planned(
    model: torch.nn.Module,
    data: list[dict],
    hf: list[float],
    budget: int,
    source: str | None,
    label: str,
) -> tuple[dict[str, Any], AdaccSession]:
    """Train each batch twice under `prepare` (the first planning its bucket), from the profiles
    in `source` where they match."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    t0 = time.perf_counter()
    session = prepare(model, budget, optimizer=opt, adaptive=False, profile_from=source)
    out: dict[str, Any] = {"buckets": []}
    for i, (batch, hf_s) in enumerate(zip(data, hf, strict=True)):
        wall = step(model, opt, batch)
        session.step_done(2 * i + 1)  # on CUDA: an interpolated bucket's first step is checked
        steady = step(model, opt, batch)
        session.step_done(2 * i + 2)
        peak = measure_step_peak(model, batch, opt).peak_nbytes  # every allocation, exact
        opt.zero_grad(set_to_none=True)
        plan = session.current
        predicted = plan.policy.metadata.get("predicted", {}).get("peak_nbytes")
        phases = plan.policy.metadata.get("planning_ms", {})
        planning = sum(phases.values()) / 1e3
        row = {
            "shape": list(batch["input_ids"].shape),
            "planning_s": planning,
            "phases_ms": phases,
            "planning_step_s": wall,
            "adacc_step_s": steady,
            "hf_full_step_s": hf_s,
            "planning_in_hf_steps": planning / hf_s,
            "predicted_peak_nbytes": predicted,
            "measured_peak_nbytes": peak,
            "over_prediction_nbytes": peak - (predicted or 0),
            "within_budget": peak <= budget,
            "within_5pct_of_prediction": bool(predicted)
            and abs(peak - predicted) <= 0.05 * predicted,
            "memory": "interpolated" if plan.profile.memory_from else "measured",
            "policy": plan.policy.fingerprint(),
        }
        out["buckets"].append(row)
        print(
            f"{label} {tuple(row['shape'])}: planning {format_phases(phases)} = "
            f"{row['planning_in_hf_steps']:.2f} HF steps ({hf_s:.2f} s); {row['memory']} memory, "
            f"step peak {peak / 2**20:.1f} MiB, predicted {(predicted or 0) / 2**20:.1f} MiB, "
            f"budget {budget / 2**20:.1f} MiB; measured - predicted {peak - (predicted or 0):+,} B",
            flush=True,
        )
    out["total_s"] = time.perf_counter() - t0
    # buckets whose first step allocated more than their interpolated memory predicted (CUDA)
    out["measured_after_check"] = [list(k) for k in sorted(session.store.full_memory)]
    return out, session


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cuda: the allocator's counters, no replay")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/profile-breakdown-cpu.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    env.set_threads(device, args.threads)
    result = env.header("profile_breakdown", argv, device)
    result["settings"] = vars(args)
    with tempfile.TemporaryDirectory() as saved:
        result["runs"] = [run(kind, args.fraction, saved, device) for kind in args.runs]
    rows = [r for run_ in result["runs"] for k in ("first", "again") for r in run_[k]["buckets"]]
    kept = all(r["within_budget"] and r["within_5pct_of_prediction"] for r in rows)
    result["every_bucket_within_budget_and_5pct"] = kept
    write_json(args.out, result)
    print(f"every bucket within its budget and 5 % of its prediction: {kept}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
