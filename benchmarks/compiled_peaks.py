"""Compiled step peaks against the plan's prediction, across budgets (issue 34).

    python benchmarks/compiled_peaks.py --model llama-cpu --out benchmarks/results/compiled-peaks-llama-cpu.json

One model of the CPU preset, AdamW with its states present. A compile profile
(`prepare(..., compile=backend)`) gives the least step peak and no checkpointing's; at each
`--fractions` of the way between them a fresh copy of the model is planned, compiled whole with
the backend (``--regional``: each block compiled on its own) and one training step measured by
the allocator (`measure_step_peak`): its peak against the prediction and the budget, with the
plan and whether it keeps ops.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import measure_step_peak, prepare  # noqa: E402
from adacc_hf.adapters import get_adapter  # noqa: E402
from adacc_hf.schema import variant_key  # noqa: E402
from adacc_hf.solver.step import extreme_peaks  # noqa: E402
from benchmarks.harness.models import find_specs  # noqa: E402
from benchmarks.harness.steps import optimizer_with_states  # noqa: E402

MiB = 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-cpu")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.03, 0.25, 0.5, 0.75, 1.0])
    p.add_argument(
        "--regional",
        action="store_true",
        help="compile each block on its own (layer.compile()) instead of the model whole",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    (spec,) = find_specs("cpu", [args.model])
    base, _ = spec.build(torch.device("cpu"), torch.float32)
    batch = spec.batch(base, spec.main_batch)
    kw = dict(adaptive=False, profile_repeats=1, compile=args.backend)
    probe_model = copy.deepcopy(base)
    probe = prepare(
        probe_model, "100GiB", batch, optimizer=optimizer_with_states(probe_model), **kw
    )
    lo, hi = extreme_peaks(probe.profile, probe.ctx.static_memory(), 1, "full")
    res: dict = {
        "model": spec.name,
        "batch": [spec.main_batch, spec.seq_len],
        "backend": args.backend,
        "regional": args.regional,
        "torch": torch.__version__,
        "command": "python benchmarks/compiled_peaks.py " + " ".join(argv or sys.argv[1:]),
        "least_nbytes": lo.peak_nbytes,
        "no_checkpointing_nbytes": hi.peak_nbytes,
        "measured_parts": probe.profile.compiled,
        "profile_phases_ms": probe.profile.phase_ms,
        "rows": [],
    }
    probe.close()
    for f in args.fractions:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        opt = optimizer_with_states(model)
        budget = int(lo.peak_nbytes + f * (hi.peak_nbytes - lo.peak_nbytes))
        session = prepare(model, budget, batch, optimizer=opt, **kw)
        policy = session.handle.policy
        predicted = policy.metadata["predicted"]["peak_nbytes"]
        keeps = any(v.actions for g in policy.groups.values() for v in g.variants if v.count)
        tables = [
            variant_key(name, v)
            for name, g in policy.groups.items()
            for v in g.variants
            if v.count and v.checkpoint and v.actions
        ]
        measured_tables = sum(
            len(session.profile.variant_transients.get(t, ())) == 3 for t in tables
        )
        if args.regional:
            for group in get_adapter(model).block_groups(model):
                for block in group.modules:
                    block.compile(backend=args.backend)
            step = model
        else:
            step = torch.compile(model, backend=args.backend)
        step(**batch).loss.backward()  # compiles
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = measure_step_peak(step, batch, opt).peak_nbytes
        session.close()
        row = {
            "fraction": f,
            "budget_nbytes": budget,
            "predicted_nbytes": predicted,
            "measured_nbytes": peak,
            "error": peak / predicted - 1,
            "fits": peak <= budget,
            "keeps_ops": keeps,
            "moment": policy.metadata["predicted"].get("moment"),
            "tables": len(tables),
            "tables_measured_compiled": measured_tables,
            "policy": policy.summary(),
        }
        res["rows"].append(row)
        print(
            f"{spec.name} {f:g}: budget {budget / MiB:.1f} predicted {predicted / MiB:.1f} "
            f"measured {peak / MiB:.1f} MiB ({row['error'] * 100:+.1f} %) at {row['moment']}, "
            f"{measured_tables}/{len(tables)} tables measured {row['policy']}",
            flush=True,
        )
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
