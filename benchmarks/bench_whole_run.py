"""Whole-run wall time, profiling included: SmolLM2 LoRA under dynamic padding through the plain
`Trainer`, Adacc against HF checkpointing (issue 32).

    python benchmarks/bench_whole_run.py [--steps 200] [--batch 4] [--fraction 0.5]
        [--out benchmarks/results/whole-run-lora-cpu.json]

Real SmolLM2-135M (offline), PEFT LoRA r 16 on every projection, fp32, AdamW, rows of real
Shakespeare text of random lengths (36-192 tokens), length-grouped and padded to each batch's
longest row (`bench_first_step`): the batches fall into several buckets. The budget is
`--fraction` of the way from HF checkpointing's measured step peak to no checkpointing's at the
longest batch (`bench_first_step.baseline`); HF checkpointing fits in it.

Two pairs of runs, each pair side by side (two processes, one thread each, so both see the same
machine): HF checkpointing against Adacc profiling from nothing, then HF checkpointing against
Adacc started again in the same output directory, where the first Adacc run saved its profiles
(``adacc_profiles.json``: the Trainer reads them back). Each run's time is its whole
``trainer.train()``: profiling, planning and every step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from benchmarks.bench_first_step import baseline, make_model, token_rows, trainer_for  # noqa: E402
from benchmarks.harness import env  # noqa: E402
from benchmarks.harness.report import write_json  # noqa: E402


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One run (``--only hf|adacc``) in this process, on one thread."""
    from adacc_hf import AdaccCallback
    from adacc_hf.engine.shapes import key_text

    env.set_threads(torch.device("cpu"), 1)
    model, tok = make_model("lora")
    rows = token_rows(tok, args.steps * args.batch, args.min_len, args.max_len, args.seed)
    hf = args.only == "hf"
    callbacks = [] if hf else [AdaccCallback(budget=args.budget)]
    trainer, collate = trainer_for(
        "lora", model, tok, rows, args, args.output_dir, args.steps, hf, callbacks
    )
    t0 = time.perf_counter()
    trainer.train()
    out: dict[str, Any] = {"run": args.only, "train_s": time.perf_counter() - t0}
    out["buckets"] = len(set(collate.keys))
    if not hf:
        session = callbacks[0].session
        plans = [p for k, p in session.plans.items() if k is not None]
        out["planning_s"] = (
            sum(sum(p.policy.metadata.get("planning_ms", {}).values()) for p in plans) / 1e3
        )
        out["plans"] = len(plans)
        out["profiles"] = {
            key_text(k): ("interpolated" if p.memory_from else "measured")
            for k, p in session.profiles.items()
        }
    return out


def pair(args: argparse.Namespace, second: str, out_dir: str) -> list[dict[str, Any]]:
    """HF checkpointing and `second` side by side, each in its own process."""
    procs = []
    for which, directory in (("hf", tempfile.mkdtemp()), (second, out_dir)):
        cmd = [sys.executable, __file__, "--only", which, "--output-dir", directory]
        cmd += ["--budget", str(args.budget), "--steps", str(args.steps)]
        cmd += ["--batch", str(args.batch), "--min-len", str(args.min_len)]
        cmd += ["--max-len", str(args.max_len), "--seed", str(args.seed)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a run failed ({p.args})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    hf_s, other_s = results[0]["train_s"], results[1]["train_s"]
    print(f"{second}: {other_s:.0f} s, HF checkpointing {hf_s:.0f} s: {hf_s / other_s:.3f}x")
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-len", type=int, default=36)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/whole-run-lora-cpu.json"))
    p.add_argument("--only", choices=["hf", "adacc", "again"], help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.only:
        print(json.dumps(one_run(args)))
        return
    result = env.header("whole_run", argv, torch.device("cpu"))
    result["settings"] = {k: v for k, v in vars(args).items() if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        env.set_threads(torch.device("cpu"), 1)
        ckpt, plain = (baseline("lora", args, c, tmp) for c in (True, False))
        args.budget = int(ckpt + args.fraction * (plain - ckpt))
        result["budget_nbytes"] = args.budget
        result["hf_checkpointing_peak_nbytes"], result["no_checkpointing_peak_nbytes"] = ckpt, plain
        saved = str(Path(tmp) / "adacc")
        result["first"] = pair(args, "adacc", saved)
        result["again"] = pair(args, "again", saved)
    for name in ("first", "again"):
        hf, adacc = result[name]
        result[f"{name}_speedup"] = hf["train_s"] / adacc["train_s"]
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
