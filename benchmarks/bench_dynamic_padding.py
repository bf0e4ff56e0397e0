"""Step time under dynamic padding against the same run at one fixed length (issue 29, item 2).

    python benchmarks/bench_dynamic_padding.py [--lengths 449 512] [--rounds 40] [--threads 1]

Real batches are padded to their longest row, not to their bucket: every step has another length.
One LLaMA-shaped model (random init) runs a mixed retain / recompute policy (`random_mix`); each
round draws ``--steps`` lengths uniformly from ``--lengths`` (a range inside one bucket) and runs,
in alternating order, the *dynamic* run (one step per drawn length) and the *fixed* run (as many
steps, all at the drawn lengths' mean: the same tokens), each after one untimed step; and the
same two runs on a copy of the model under transformers' full checkpointing (``hf_full``), which
shows what varying shapes cost without Adacc. A round's figure per run is its mean step time; the
verdict is on the per-round ratio dynamic / fixed (median and bootstrap interval,
`benchmarks.harness.stats`): ``holds`` when the whole interval lies at or below 1 +
``--tolerance`` (2 %). Both clocks are kept: wall time and this process's CPU time (less
sensitive to other processes on a shared machine). Slot-table builds (the slow path: region
hooks, string keys) are counted per Adacc run, and minor page faults per step per run. Freed
memory is kept (`harness.env.cache_freed_memory`, as the other benchmarks run) unless
``--system-allocator``: glibc's default returns pages to the system, and a step faults them in
again by an amount that drifts from step to step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from adacc_hf import apply_adacc, trace_model
from adacc_hf.policy.builders import random_mix
from benchmarks.harness import env
from benchmarks.harness.report import write_json
from benchmarks.harness.stats import bootstrap, verdict

RESULTS = Path(__file__).resolve().parent / "results"


def build(hidden: int, layers: int, heads: int, max_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        attention_dropout=0.1,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def batch_of(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@contextlib.contextmanager
def counted_builds():
    """Count slot-table builds: `slots.build_table` wherever the runtime imported it."""
    mods = [m for n, m in sys.modules.items() if n.startswith("adacc_hf.runtime.")]
    mods = [m for m in mods if hasattr(m, "build_table")]
    original = mods[0].build_table
    count = [0]

    def counting(*a: Any, **k: Any) -> Any:
        count[0] += 1
        return original(*a, **k)

    for m in mods:
        m.build_table = counting
    try:
        yield count
    finally:
        for m in mods:
            m.build_table = original


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    model(**batch).loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0


def _hf_full(model: torch.nn.Module) -> None:
    kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:  # transformers < 5.23
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable(**kwargs)


def _ratio(rows: dict, a: str, b: str, c: int, tolerance: float) -> dict[str, Any]:
    """Round by round, the mean step of run `a` over run `b` (clock `c`): median, interval,
    verdict against 1 + `tolerance`."""
    ratios = [x[c] / y[c] for x, y in zip(rows[a], rows[b], strict=True)]
    ci = bootstrap(ratios)
    return {
        "median": statistics.median(ratios),
        "interval": ci,
        "verdict": verdict(*ci, 0.0, 1.0 + tolerance),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    lo, hi = args.lengths
    model = build(args.hidden, args.layers, args.heads, hi)
    baseline = build(args.hidden, args.layers, args.heads, hi)  # same weights (seeded)
    _hf_full(baseline)
    policy = random_mix(trace_model(model, batch_of(args.batch, hi, 0)), seed=args.policy_seed)
    rng = random.Random(args.seed)
    names = ("adacc_dynamic", "adacc_fixed", "hf_full_dynamic", "hf_full_fixed")
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    builds = dict.fromkeys(names[:2], 0)
    faults: dict[str, list[float]] = {n: [] for n in names}  # minor page faults per step
    lengths_seen: set[int] = set()
    with apply_adacc(model, policy) as handle, counted_builds() as count:
        for r in range(args.rounds):
            lengths = [rng.randint(lo, hi) for _ in range(args.steps + 1)]
            lengths_seen.update(lengths)
            mean = round(statistics.mean(lengths[1:]))
            order = list(names) if r % 2 == 0 else list(reversed(names))
            for name in order:
                which = model if name.startswith("adacc") else baseline
                plan = lengths if name.endswith("dynamic") else [mean] * len(lengths)
                before = count[0]
                per_round = []
                for i, n in enumerate(plan):
                    if i == 1:
                        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t = step(which, batch_of(args.batch, n, 1000 * r + i))
                    if i:  # the first step of each run is a warm-up
                        per_round.append(t)
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                faults[name].append((f1 - f0) / len(per_round))
                if name in builds:
                    builds[name] += count[0] - before
                rows[name].append(tuple(statistics.mean(t[c] for t in per_round) for c in (0, 1)))
        tables = {p: len(rt._tables) for p, rt in handle.runtimes.items()}
        assert not handle.problems, handle.problems
    out: dict[str, Any] = {
        "builds": builds,
        "tables_per_block_at_end": tables,
        "distinct_lengths": len(lengths_seen),
        # the allocator: varying sizes make glibc hand pages back and fault them in again
        "minor_faults_per_step": {k: statistics.median(v) for k, v in faults.items()},
    }
    tol = args.tolerance
    for c, clock in enumerate(("wall", "cpu")):
        out[clock] = {
            "median_step_ms": {
                k: statistics.median(v[c] for v in rs) * 1e3 for k, rs in rows.items()
            },
            "round_mean_step_ms": {k: [v[c] * 1e3 for v in rs] for k, rs in rows.items()},
            # the claim: Adacc under dynamic padding within `tol` of Adacc at fixed shapes
            "adacc_dynamic_over_fixed": _ratio(rows, "adacc_dynamic", "adacc_fixed", c, tol),
            # what varying shapes cost without Adacc (allocator, kernels), for comparison
            "hf_full_dynamic_over_fixed": _ratio(rows, "hf_full_dynamic", "hf_full_fixed", c, tol),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs=2, default=[449, 512], help="lo hi (one bucket)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run and round")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave glibc malloc as it is (default: keep freed memory, as the other benchmarks "
        "do; harness.env.cache_freed_memory)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "dynamic-padding-cpu.json")
    args = p.parse_args(argv)
    device = torch.device("cpu")
    env.set_threads(device, args.threads)
    allocator = env.cache_freed_memory(device, not args.system_allocator)
    out: dict[str, Any] = {
        **env.header("dynamic_padding", argv, device),
        "allocator": allocator,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    out.update(run(args))
    out["load_average_at_end"] = os.getloadavg()
    for clock in ("wall", "cpu"):
        c = out[clock]
        med = c["median_step_ms"]
        for name in ("adacc", "hf_full"):
            r = c[f"{name}_dynamic_over_fixed"]
            lo, hi = r["interval"]
            print(
                f"[{clock}] {name}: dynamic {med[name + '_dynamic']:.1f} ms/step, fixed "
                f"{med[name + '_fixed']:.1f} ms/step; dynamic / fixed {r['median']:.4f} "
                f"[{lo:.4f}, {hi:.4f}] (<= {1 + args.tolerance}: {r['verdict']})"
            )
    print(f"table builds {out['builds']}; tables per block {out['tables_per_block_at_end']}")
    print(f"minor page faults per step {out['minor_faults_per_step']}")
    write_json(args.json, out, indent=2, sort_keys=True)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
