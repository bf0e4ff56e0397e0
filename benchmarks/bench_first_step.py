"""Every step's peak, profiling included, against the budget: SmolLM2 under dynamic padding
(issue 28, the third acceptance point).

    python benchmarks/bench_first_step.py [--runs full lora sft] [--steps 8] [--batch 8]

Real SmolLM2-135M (offline), rows of real Shakespeare text of random lengths (``--min-len`` to
``--max-len`` tokens), each batch padded to its longest row (length-grouped sampling, so the
batches fall into several buckets). Three runs: a full fine-tune and a PEFT LoRA fine-tune (r 16 on
every projection) under a plain `Trainer` + `AdaccCallback`, and a full fine-tune under TRL's
`SFTTrainer` + `AdaccCallback` (its own chunked LM head). Each run's budget is halfway between HF
activation checkpointing's and no checkpointing's step peaks, both measured by the same trainer on
the longest batch (two steps: the second, with the optimizer's states, is the peak). Every
optimizer step's peak is measured by an independent storage meter (`runtime.capacity.DeviceMeter`,
`tests/step_meter.py`): the live bytes of the whole step, the first step's profiling and planning
included. Results: ``benchmarks/results/first-step-cpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import Trainer, TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `benchmarks` and the test meter importable
    sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

from step_meter import StepMeter, metered  # noqa: E402

from adacc_hf import AdaccCallback  # noqa: E402
from adacc_hf.assets import load_smollm2, shakespeare_text  # noqa: E402
from adacc_hf.engine.shapes import shape_key  # noqa: E402
from benchmarks.harness import env  # noqa: E402
from benchmarks.harness.report import write_json  # noqa: E402

MiB = 2**20
RESULTS = ROOT / "benchmarks" / "results"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRL_KWARGS = {"fused_lm_head": True, "use_cache": False}


def token_rows(tokenizer: Any, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`n` consecutive spans of the plays' tokens, of random lengths in [lo, hi]; the first is
    `hi` long, so the run's longest bucket always comes."""
    rng = random.Random(seed)
    lengths = [hi] + [rng.randint(lo, hi) for _ in range(n - 1)]
    text = shakespeare_text(sum(lengths) * 6)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    out, at = [], 0
    for k in lengths:
        out.append(ids[at : at + k])
        at += k
    return out


class Collate:
    """Dynamic padding (each batch to its longest row; labels -100 on padding); records each
    batch's shape key in the order they are made."""

    def __init__(self, pad: int) -> None:
        self.pad = pad
        self.keys: list[tuple] = []

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        batch["labels"] = ids.masked_fill(mask == 0, -100)
        self.keys.append(shape_key(batch, False))
        return batch


def make_model(kind: str) -> tuple[torch.nn.Module, Any]:
    model, tokenizer = load_smollm2()
    model.config.use_cache = False
    if kind == "lora":
        import peft

        config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, config)
    return model.train(), tokenizer


def no_checkpointing(cls: type) -> dict[str, bool]:
    names = {f.name for f in dataclasses.fields(cls)}
    key = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {key: False}


def trainer_for(
    kind: str,
    model: Any,
    tokenizer: Any,
    rows: list[list[int]],
    args: argparse.Namespace,
    out: str,
    steps: int,
    checkpointing: bool,
    callbacks: list,
) -> tuple[Any, Collate]:
    """The run's trainer (SFTTrainer for ``sft``), fp32, AdamW, one row order for every run."""
    import datasets

    data = datasets.Dataset.from_dict({"input_ids": rows})
    common = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        train_sampling_strategy="group_by_length",
    )
    ckpt = {k: checkpointing for k in no_checkpointing(TrainingArguments)}
    collate = Collate(tokenizer.pad_token_id)
    if kind == "sft":
        import trl

        cfg = trl.SFTConfig(**common, **ckpt, max_length=args.max_len, bf16=False)
        trainer = trl.SFTTrainer(
            model=model,
            args=cfg,
            train_dataset=data,
            processing_class=tokenizer,
            data_collator=collate,
            callbacks=callbacks,
        )
    else:
        targs = TrainingArguments(**common, **ckpt, remove_unused_columns=False)
        trainer = Trainer(
            model=model, args=targs, train_dataset=data, data_collator=collate, callbacks=callbacks
        )
    return trainer, collate


@contextlib.contextmanager
def phases(meter: Any, log: list[dict]) -> Iterator[None]:
    """Record each profiling phase's metered peak (bytes alive before, highest, after) in `log`:
    the library's profiling functions wrapped where they are looked up, for this run only."""
    import adacc_hf.engine.solving as solving
    import adacc_hf.profiler as profiler

    names = {
        profiler: ("run_representatives", "measure_heads", "measure", "measure_grad_errors"),
        solving: ("measure_policy", "policy_block_error"),
    }
    saved = [(mod, n, getattr(mod, n)) for mod, ns in names.items() for n in ns]

    def wrap(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            before, outer = meter.live_nbytes, meter.reset_peak()
            try:
                return fn(*a, **k)
            finally:
                top = meter.peak_nbytes
                log.append(
                    {"phase": name, "before": before, "peak": top, "after": meter.live_nbytes}
                )
                meter.peak_nbytes = max(outer, top)

        return run

    for mod, n, fn in saved:
        setattr(mod, n, wrap(n, fn))
    try:
        yield
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)


def metered_train(trainer: Any, model: Any, log: list[dict] | None = None) -> list[int]:
    """Each optimizer step's peak live bytes, by the independent meter (profiling phases' peaks
    into `log`)."""
    with metered(model) as meter, phases(meter, log if log is not None else []):
        steps = StepMeter(meter)
        trainer.add_callback(steps)
        trainer.train()
    return steps.peaks


def baseline(kind: str, args: argparse.Namespace, checkpointing: bool, out: str) -> int:
    """HF checkpointing's (or no checkpointing's) steady step peak at the longest batch."""
    model, tok = make_model(kind)
    rows = token_rows(tok, args.batch, args.max_len, args.max_len, args.seed)
    trainer, _ = trainer_for(kind, model, tok, rows * 2, args, out, 2, checkpointing, [])
    peaks = metered_train(trainer, model)
    del trainer, model
    return max(peaks)


def adacc_run(kind: str, args: argparse.Namespace, budget: int, out: str) -> dict[str, Any]:
    model, tok = make_model(kind)
    rows = token_rows(tok, args.steps * args.batch, args.min_len, args.max_len, args.seed)
    callback = AdaccCallback(budget=budget)
    trainer, collate = trainer_for(kind, model, tok, rows, args, out, args.steps, False, [callback])
    t0 = time.perf_counter()
    log: list[dict] = []
    peaks = metered_train(trainer, model, log)
    seconds = time.perf_counter() - t0
    session = callback.session
    keys = collate.keys[: len(peaks)]
    steps = [
        {"step": i + 1, "shape": list(k), "peak_nbytes": p, "over_nbytes": p - budget}
        for i, (k, p) in enumerate(zip(keys, peaks, strict=False))
    ]
    plans = {
        str(list(k)): p.policy.metadata.get("predicted", {}).get("peak_nbytes")
        for k, p in session.plans.items()
        if k is not None
    }
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "steps": steps,
        "predicted_peaks": plans,
        "profiling_phases": log,
        "losses": losses,
        "train_s": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["full", "lora", "sft"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=36)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="budget: this far from HF checkpointing's step peak (0) to no checkpointing's (1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS / "first-step-cpu.json"))
    args = p.parse_args(argv)
    env.set_threads(torch.device("cpu"), args.threads)
    result: dict[str, Any] = {**env.header("first-step", argv, "cpu"), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.runs:
            hf = baseline(kind, args, True, tmp)
            none = baseline(kind, args, False, tmp)
            budget = int(hf + args.fraction * (none - hf))
            print(
                f"[{kind}] HF checkpointing {hf / MiB:.1f} MiB, no checkpointing "
                f"{none / MiB:.1f} MiB; budget {budget / MiB:.1f} MiB",
                flush=True,
            )
            run = adacc_run(kind, args, budget, tmp)
            for s in run["steps"]:
                flag = "ok" if s["over_nbytes"] <= 0 else f"OVER +{s['over_nbytes'] / MiB:.1f} MiB"
                print(
                    f"[{kind}]   step {s['step']} {tuple(s['shape'])}: "
                    f"{s['peak_nbytes'] / MiB:8.1f} MiB  {flag}",
                    flush=True,
                )
            for ph in run["profiling_phases"]:
                print(
                    f"[{kind}]   profiling {ph['phase']:20s} alive {ph['before'] / MiB:8.1f} "
                    f"peak {ph['peak'] / MiB:8.1f} MiB",
                    flush=True,
                )
            worst = max(s["peak_nbytes"] for s in run["steps"])
            result["runs"][kind] = {
                "hf_checkpointing_nbytes": hf,
                "no_checkpointing_nbytes": none,
                "budget_nbytes": budget,
                "max_peak_nbytes": worst,
                "within_budget": worst <= budget,
                **run,
            }
            write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
