"""Command line: ``adacc-hf demo`` and ``adacc-hf plan`` (on a device here, or for a GPU this
machine does not have: ``--device h200``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

#: Named configurations for `plan --config` (random init unless the name says pretrained).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12}),
    "gpt2-medium": ("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt2-large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
    ),
    "t5-small": (
        "t5",
        {
            "d_model": 512,
            "d_ff": 2048,
            "num_layers": 6,
            "num_heads": 8,
            "d_kv": 64,
            "decoder_start_token_id": 0,
        },
    ),
    "bert-base": ("bert", {}),
    "tiny-llama": ("tiny", {"family": "llama"}),
    "tiny-gpt2": ("tiny", {"family": "gpt2"}),
    "tiny-t5": ("tiny", {"family": "t5"}),
    "tiny-bert": ("tiny", {"family": "bert"}),
}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class _BadInput(Exception):
    pass


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def demo(args: argparse.Namespace) -> int:
    """Measured activation memory of the real SmolLM2-135M under four per-op policies."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import default_data_collator

    from .assets import load_smollm2, shakespeare_splits
    from .runtime import apply_adacc, attention_recompute_policy, uniform_policy
    from .runtime.memory import activation_memory_report

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
        "no checkpointing": uniform_policy(model, "retain", batch),
        "full recompute": uniform_policy(model, "recompute", batch),
        "attention-core recompute": attention_recompute_policy(model, batch),
        "uniform compression": uniform_policy(model, "compress", batch),
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
            f"{name:26s} {_mib(blocks / n_blocks):>9s} {_mib(blocks):>10s} "
            f"{_mib(report.other):>9s} {blocks / base:7.3f} {loss:7.4f}"
        )
    if args.show_policy:
        print("\nUniform-compression policy (one block):\n")
        print(policies["uniform compression"].table())
    return 0


def _build_model(args: argparse.Namespace):
    import torch
    import transformers

    from . import assets

    dtype = getattr(torch, _DTYPES[args.dtype])
    if args.model:
        if not os.path.isdir(args.model):
            raise _BadInput(f"--model {args.model!r} is not a local model directory (offline)")
        config = transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
        cls = _auto_class(config)
        return cls.from_pretrained(args.model, local_files_only=True, dtype=dtype), config
    name = args.config
    if name == "smollm2-135m":
        model, _ = assets.load_smollm2(dtype=dtype)
        return model, model.config
    if name not in CONFIGS:
        known = ", ".join(["smollm2-135m", *CONFIGS])
        raise _BadInput(f"unknown --config {name!r}; known: {known}")
    family, kwargs = CONFIGS[name]
    if family == "tiny":
        model = assets.tiny_model(kwargs["family"]).to(dtype)
        return model, model.config
    config = transformers.AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(0)
    return _auto_class(config).from_config(config, dtype=dtype), config


def _auto_class(config):
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if config.model_type == "bert":
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForCausalLM


def _paper_config(args: argparse.Namespace) -> Any:
    """The transformers config of `args` (its weights are never read on paper)."""
    import transformers

    from .assets import SMOLLM2_CONFIG

    if args.model:
        if not os.path.isdir(args.model):
            raise _BadInput(f"--model {args.model!r} is not a local model directory (offline)")
        return transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
    if args.config == "smollm2-135m":
        return transformers.LlamaConfig(**SMOLLM2_CONFIG)
    if args.config not in CONFIGS:
        raise _BadInput(
            f"unknown --config {args.config!r}; known: smollm2-135m, {', '.join(CONFIGS)}"
        )
    family, kwargs = CONFIGS[args.config]
    if family == "tiny":
        from .assets import tiny_config

        return tiny_config(kwargs["family"])
    return transformers.AutoConfig.for_model(family, **kwargs)


def plan_on_device(args: argparse.Namespace) -> int:
    """The plan a GPU this machine does not have gets: profiled, solved and its step run dry,
    priced from the device's committed table (`devices`)."""
    import torch

    from .devices.plan import empty_model, plan_for_device, random_batch
    from .devices.table import load_device
    from .solver.explain import REASONS, not_compressed
    from .units import fmt_bytes as fb

    table = load_device(args.device)
    if (args.budget is None) == (args.fraction is None):
        raise _BadInput("give exactly one of --budget or --fraction (0: the least, 1: none)")
    budget = None
    if args.budget is not None:
        from .solver import parse_budget

        spec = str(args.budget).strip()
        if spec == "auto":
            raise _BadInput("--budget auto reads a live device's free memory: give bytes or %")
        if spec.endswith("%"):
            budget = int(float(spec[:-1]) / 100 * table.memory_gib * 2**30)
        else:
            budget = parse_budget(spec, "cpu")
    config = _paper_config(args)
    config.use_cache = False
    model = empty_model(config, getattr(torch, _DTYPES[args.dtype]))
    batch = random_batch(config, args.batch_size, args.seq_len)
    t0 = time.perf_counter()
    print(
        f"planning {args.batch_size} x {args.seq_len} {args.dtype} for {table.label} on paper "
        f"(efficiencies fitted on {len(table.calibrated_on)} committed runs)...",
        flush=True,
    )
    p = plan_for_device(
        model,
        batch,
        table,
        budget=budget,
        fraction=args.fraction,
        optimizer=args.optimizer,
        head=args.head,
        offload=args.offload,
        codecs=args.codecs.split(",") if args.codecs else None,
        codec_speed=args.codec_speed,
        expandable=args.allocator != "default",
        fit_reserved=args.allocator != "off",
    )
    lo, hi = p.window
    print(f"done in {time.perf_counter() - t0:.1f} s")
    print(
        f"budget {fb(p.budget_nbytes)} of {table.label}'s {table.memory_gib:.0f} GiB; any plan "
        f"fits from {fb(lo)}, no checkpointing needs {fb(hi)}"
    )
    if p.policy is not None:
        print(p.policy.table())
        print(f"plan: {p.policy.summary()}")
    for s in p.steps.values():
        top = max(s.peak_nbytes, s.reserved_nbytes or 0)
        fits = "" if top <= p.budget_nbytes else "  (over the budget)"
        print(
            f"  {s.label:22s} step {s.step_ms:8.1f} ms (host {s.host_ms:6.1f})  allocated peak "
            f"{fb(s.peak_nbytes)}, reserved {fb(s.reserved_nbytes or 0)}{fits}"
        )
    if p.reserve_nbytes:
        print(
            f"  planned with {fb(p.reserve_nbytes)} kept free for what the {args.allocator} "
            "allocator reserves above the allocated peak"
        )
    if "adacc" in p.steps and "hf_full" in p.steps:
        print(
            f"Adacc {p.speedup():.3f}x HF full checkpointing's speed (predicted peak "
            f"{fb(p.predicted_peak_nbytes or 0)}, step {p.predicted_step_ms or 0:.1f} ms)"
        )
    if p.policy is not None and p.profile is not None:
        why = not_compressed(p.profile, p.policy)
        counts: dict[str, int] = {}
        for reasons in why.values():
            for r in reasons.values():
                counts[r] = counts.get(r, 0) + 1
        for r, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:3d} op(s) not compressed: {REASONS[r]}")
    if args.out:
        p.policy.save(args.out)
        print(f"policy written to {args.out}")
    if args.profile_out and p.profile is not None:
        with open(args.profile_out, "w") as f:
            f.write(p.profile.to_json())
    return 0


def plan(args: argparse.Namespace) -> int:
    """Profile a model on a random batch of the given shape, solve for the budget, print."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .devices.table import known_devices

    if args.device in known_devices():
        return plan_on_device(args)
    if args.budget is None:
        raise _BadInput("--budget is needed (e.g. 20GiB, 80%%, auto, or bytes)")
    import torch

    from .adapters import get_adapter
    from .profiler import profile_model
    from .runtime.peak import live_state_nbytes
    from .solver import budget_window, estimate_static_memory, parse_budget, solve
    from .solver.budget import resolve_budget

    if (args.model is None) == (args.config is None):
        raise _BadInput("give exactly one of --model PATH or --config NAME")
    if args.batch_size < 1 or args.seq_len < 2:
        raise _BadInput("--batch-size must be >= 1 and --seq-len >= 2")
    device = torch.device(args.device)
    budget = parse_budget(args.budget, device)  # fails early on a malformed budget
    model, config = _build_model(args)
    get_adapter(model)  # fails early on an unsupported model
    model.to(device).train()
    # "auto" counts what the model holds, read once: the free memory moves between two reads
    resolved = resolve_budget(args.budget, device, live_state_nbytes(model))
    budget = resolved.nbytes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
    batch: dict[str, Any] = {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
    if getattr(config, "use_cache", False):
        batch["use_cache"] = False
    static = estimate_static_memory(model, optimizer=args.optimizer)
    codecs = args.codecs.split(",") if args.codecs else None
    t0 = time.perf_counter()
    print(
        f"profiling {args.batch_size} x {args.seq_len} on {device} (one block per group, "
        f"{args.repeats} timed runs per op; minutes on a CPU)...",
        flush=True,
    )
    profile = profile_model(model, batch, codecs=codecs, repeats=args.repeats)
    print(
        f"profiled {profile.num_blocks} blocks on {profile.device} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    sol = solve(profile, budget, static_nbytes=static, codecs=codecs)
    print(f"budget: {resolved.how}")
    print(budget_window(profile, static, budget))
    print(static.describe())
    print(sol.policy.table())
    from .units import fmt_bytes as fb

    print(
        f"\npredicted: activations held {fb(sol.held_nbytes)} (no checkpointing "
        f"{fb(profile.no_checkpoint_nbytes())}, full recompute "
        f"{fb(profile.full_recompute_nbytes())}), transient {fb(sol.transient_nbytes)}, peak "
        f"{fb(sol.peak_nbytes)} of {fb(budget)}; +{sol.added_ms:.1f} ms per step; solved in "
        f"{sol.solve_ms:.0f} ms ({sol.status})"
    )
    if args.out:
        sol.policy.save(args.out)
        print(f"policy written to {args.out}")
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            f.write(profile.to_json())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adacc-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="measure SmolLM2-135M activation memory under adacc policies")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--show-policy", action="store_true", help="print the per-op table")
    p.set_defaults(func=demo)
    q = sub.add_parser("plan", help="profile a model and solve the per-op policy for a budget")
    q.add_argument("--model", help="local model directory (config.json + weights)")
    q.add_argument("--config", help=f"named config: smollm2-135m, {', '.join(CONFIGS)}")
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--seq-len", type=int, default=512)
    q.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    q.add_argument("--budget", help="e.g. 20GiB, 20GB, 80%%, auto, or bytes")
    q.add_argument(
        "--device",
        default="cuda" if _cuda_available() else "cpu",
        help="a torch device to profile on, or a GPU to plan for on paper: h100, h200",
    )
    q.add_argument("--fraction", type=float, help="on paper: the budget's place in the window")
    q.add_argument(
        "--codec-speed",
        type=float,
        help="on paper: price every codec at this fraction of a copy's bandwidth",
    )
    q.add_argument("--head", default="full", choices=["full", "chunked", "auto"])
    q.add_argument(
        "--allocator",
        default="expandable",
        choices=["expandable", "default", "off"],
        help="CUDA's caching allocator the reserved peak is modelled for (expandable: what "
        "import adacc_hf sets where PYTORCH_CUDA_ALLOC_CONF is unset; off: plan the allocated "
        "peak alone, as the committed GPU runs did, the reserved peak still modelled under "
        "expandable segments)",
    )
    q.add_argument(
        "--offload", action=argparse.BooleanOptionalAction, default=None, help="on paper"
    )
    q.add_argument("--optimizer", default="adamw_torch")
    q.add_argument("--codecs", help="comma-separated codecs the solver may use")
    q.add_argument("--repeats", type=int, default=3, help="timed profiling runs")
    q.add_argument("--out", help="write the policy JSON here")
    q.add_argument("--profile-out", help="write the profile JSON here")
    q.set_defaults(func=plan)
    args = parser.parse_args(argv)
    from .errors import AdaccError

    try:
        return args.func(args)
    except (_BadInput, AdaccError) as e:
        print(f"adacc-hf {args.command}: {e}", file=sys.stderr)
        return 2


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if __name__ == "__main__":
    sys.exit(main())
