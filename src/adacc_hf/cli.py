"""Command line: ``adacc-hf demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def demo(args: argparse.Namespace) -> int:
    """Measured activation memory of the real SmolLM2-135M under four per-op policies."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import default_data_collator

    from . import Policy, activation_memory_report, apply_adacc
    from .assets import load_smollm2, shakespeare_splits

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    model.train()
    train, _ = shakespeare_splits(tokenizer, args.seq_len, args.batch_size, 1, seed=0)
    batch = default_data_collator([train[i] for i in range(args.batch_size)])
    batch["use_cache"] = False  # as the Trainer trains
    n_blocks = model.config.num_hidden_layers
    print(
        f"SmolLM2-135M (pretrained, offline), {n_blocks} blocks, batch {args.batch_size} x "
        f"{args.seq_len} tokens of Shakespeare, fp32, loaded in {time.perf_counter() - t0:.1f} s"
    )
    policies = {
        "no checkpointing": Policy.uniform(model, "retain", batch),
        "full recompute": Policy.uniform(model, "recompute", batch),
        "attention-core recompute": Policy.attention_recompute(model, batch),
        "uniform compression": Policy.uniform(model, "compress", batch),
    }
    print(
        f"\n{'policy':26s} {'MiB/block':>9s} {'blocks MiB':>10s} {'other MiB':>9s} {'vs none':>7s}"
        f" {'loss':>7s}"
    )
    base = None
    for name, policy in policies.items():
        with apply_adacc(model, policy):
            torch.manual_seed(1)
            report = activation_memory_report(model, batch)
            torch.manual_seed(1)
            loss = model(**batch).loss.item()
        blocks = sum(report.blocks.values())
        base = base or blocks
        print(
            f"{name:26s} {_mib(blocks / n_blocks):>9s} {_mib(blocks):>10s} {_mib(report.other):>9s}"
            f" {blocks / base:7.3f} {loss:7.4f}"
        )
    if args.show_policy:
        print("\nUniform-compression policy (one block):\n")
        print(policies["uniform compression"].table())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adacc-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="measure SmolLM2-135M activation memory under adacc policies")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--show-policy", action="store_true", help="print the per-op table")
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
