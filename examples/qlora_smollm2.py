"""QLoRA under a memory budget: the real SmolLM2-135M quantised by bitsandbytes (4-bit NF4 by
default, FP4 or 8-bit), LoRA r 16 on every projection, fine-tuned on Shakespeare by a plain
`transformers.Trainer` with `AdaccCallback` and dynamic padding.

The shipped weights are saved dense to a temporary folder and reloaded with a
`BitsAndBytesConfig`, as a hub checkpoint would be. The budget lies `--budget-fraction` of the way
from full recomputation's predicted step peak to no checkpointing's on the longest batch. Every
optimizer step's peak, profiling included, is measured (CPU: an independent meter of every live
storage; CUDA: ``torch.cuda.max_memory_allocated``) and printed beside the plan's prediction.
Most of the time is profiling (the budget's profile, then each new length bucket's); the loss is
that of the first `--layers` blocks alone (``--layers 0``: all 30).

    python examples/qlora_smollm2.py                       # NF4, 4 blocks, 6 steps: ~5 min, 2 cores
    python examples/qlora_smollm2.py --quant int8 --layers 0 --steps 10
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# bitsandbytes warns on CPU that its optional `kernels` hub package is missing (a slower matmul).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

import torch  # noqa: E402

if not torch.cuda.is_available():  # DeepSpeed (imported by accelerate) warns when it guesses
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import BitsAndBytesConfig, Trainer, TrainerCallback  # noqa: E402

from adacc_hf import AdaccCallback, estimate_static_memory, profile_model  # noqa: E402
from adacc_hf.assets import load_smollm2, shakespeare_text  # noqa: E402
from adacc_hf.runtime.capacity import DeviceMeter  # noqa: E402
from adacc_hf.runtime.peak import live_state_nbytes  # noqa: E402
from adacc_hf.solver import budget_between  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def quantization(args: argparse.Namespace) -> BitsAndBytesConfig:
    if args.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=args.quant,
        bnb_4bit_use_double_quant=args.double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16 if args.bf16_compute else torch.float32,
    )


def qlora_model(args: argparse.Namespace, folder: str, device: str):
    """SmolLM2 (its first `--layers` blocks) saved dense, reloaded quantised, LoRA on top."""
    dense, tok = load_smollm2()
    if args.layers:
        dense.model.layers = dense.model.layers[: args.layers]
        dense.config.num_hidden_layers = args.layers
    dense.save_pretrained(folder)
    del dense
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quantization(args), dtype=torch.float32, device_map=device
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
    model = get_peft_model(model, lora)
    model.config.use_cache = False
    # Train mode before any forward: on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit
    # weight for inference at its first eval-mode forward without gradients, and that format has
    # no backward (gemv_4bit): profiling an eval-mode model would break training.
    return model.train(), tok


def text_rows(tok, n: int, longest: int) -> list[dict[str, torch.Tensor]]:
    """`n` rows of consecutive Shakespeare tokens, of lengths from `longest` down to an eighth."""
    ids = tok(shakespeare_text(200_000), verbose=False)["input_ids"]
    lengths = [max(1, longest * k // 8) for k in (8, 3, 6, 2, 7, 4, 5, 1)]
    rows, pos = [], 0
    for i in range(n):
        k = lengths[i % len(lengths)]
        rows.append({"input_ids": torch.tensor(ids[pos : pos + k])})
        pos += k
    return rows


def pad_collate(pad_id: int):
    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            mask[i, : len(r["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }

    return collate


class Peaks(TrainerCallback):
    """Each optimizer step's measured peak and the peak its bucket's plan predicted."""

    def __init__(self, adacc: AdaccCallback, meter: DeviceMeter | None) -> None:
        self.adacc, self.meter = adacc, meter
        self.rows: list[tuple[str, int, int]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.reset_peak()
        else:
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        plan = self.adacc.session.current
        measured = (
            self.meter.peak_nbytes if self.meter is not None else torch.cuda.max_memory_allocated()
        )
        key = "x".join(str(k) for k in plan.key[:2])
        self.rows.append((key, measured, plan.policy.metadata["predicted"]["peak_nbytes"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quant", choices=["nf4", "fp4", "int8"], default="nf4")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--bf16-compute", action="store_true", help="bnb_4bit_compute_dtype=bf16")
    p.add_argument("--layers", type=int, default=4, help="blocks kept (0: all 30)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64, help="the longest row (tokens)")
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=2e-4)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    with tempfile.TemporaryDirectory() as folder:
        model, tok = qlora_model(args, folder, device)
    model.print_trainable_parameters()
    rows = text_rows(tok, 8 * args.batch, args.seq)
    collate = pad_collate(tok.pad_token_id)
    longest = {k: v.to(device) for k, v in collate([rows[0]] * args.batch).items()}
    static = estimate_static_memory(model, optimizer="adamw_torch")
    profile = profile_model(model, longest, repeats=1, codecs=[])
    budget = budget_between(profile, static, args.budget_fraction)
    print(f"static: {mib(static.resident)} resident; budget {mib(budget)}")

    train_args = transformers.TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "adacc_qlora_smollm2"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        seed=0,
        dataloader_num_workers=0,
        train_sampling_strategy="group_by_length",
        optim="adamw_torch",
        disable_tqdm=True,
    )
    adacc = AdaccCallback(budget=budget, profile_repeats=1, codecs=[])
    trainer = Trainer(
        model=model,
        args=train_args,
        train_dataset=rows,
        data_collator=collate,
        callbacks=[adacc],
    )
    if device == "cpu":
        with DeviceMeter(baseline=live_state_nbytes(model)) as meter:
            peaks = Peaks(adacc, meter)
            trainer.add_callback(peaks)
            trainer.train()
    else:
        peaks = Peaks(adacc, None)
        trainer.add_callback(peaks)
        trainer.train()
    adacc.session.close()

    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(f"\n{'step':>4} {'bucket':>8} {'measured':>12} {'predicted':>12} {'error':>8}  fits")
    for i, (key, measured, predicted) in enumerate(peaks.rows, 1):
        err = 100 * (measured - predicted) / predicted
        ok = "yes" if measured <= budget else "NO"
        print(f"{i:>4} {key:>8} {mib(measured)} {mib(predicted)} {err:+7.2f}%  {ok}")
    print(f"budget {mib(budget)}; losses {[round(x, 3) for x in losses]}")


if __name__ == "__main__":
    main()
