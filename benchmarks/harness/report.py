"""Writing results: JSON files, console rows, and the README's markdown tables.

Results JSONs are plain dicts written by `write_json` (non-finite floats become null, anything
else non-JSON its ``str``); a later field is one more key. `throughput_markdown` renders a
throughput JSON as the README's tables (``bench_throughput.py --report FILE``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MiB = 2**20
NAN = float("nan")


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_json(path: str | Path, obj: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=indent, sort_keys=sort_keys) + "\n")


def print_rows(name: str, bs: int, rows: Mapping[str, Any], baseline: str = "hf_full") -> None:
    """One line per strategy of a throughput row: tokens/s, ratios, memory, fits."""
    print(
        f"[{name}] batch {bs}: {'strategy':18s} {'tok/s':>9s} {'ratio':>6s} {'best':>6s} "
        f"{'held MiB':>9s} {'peak MiB':>9s} fits  added ms predicted / measured (cpu)"
    )
    for n, r in rows.items():
        print(
            f"{'':>{len(name) + 12}}{n:18s} {r.get('tokens_per_s', NAN):9.0f} "
            f"{r.get(f'ratio_vs_{baseline}', NAN):6.2f} "
            f"{r.get(f'ratio_best_vs_{baseline}', NAN):6.2f} "
            f"{r.get('held_nbytes', 0) / MiB:9.1f} "
            f"{(r.get('peak_nbytes') or 0) / MiB:9.1f} {r.get('fits')!s:5s} "
            f"{r.get('predicted_added_ms', NAN):7.1f} / {r.get('measured_added_ms', NAN):7.1f} "
            f"({r.get('cpu_added_ms', NAN):.1f})",
            flush=True,
        )
        if "paired_added_interval" in r or "paired_ratio_interval" in r:
            print(f"{'':>{len(name) + 30}}round by round: {paired(r)}", flush=True)


def paired(r: Mapping[str, Any]) -> str:
    """A row's per-round comparisons (`harness.stats`): added ms and, for Adacc, the ratio to the
    best fitting baseline, each with its interval and verdict."""
    parts = []
    if "paired_added_interval" in r:
        lo, hi = r["paired_added_interval"]
        parts.append(
            f"added {r['paired_added_ms']:.1f} ms [{lo:.1f}, {hi:.1f}], predicted "
            f"{r['predicted_added_ms']:.1f}: {r.get('added_verdict', '-')}"
        )
    if "paired_ratio_interval" in r:
        lo, hi = r["paired_ratio_interval"]
        parts.append(
            f"vs {r['best_fitting_baseline']} {r['paired_ratio_vs_best_fitting']:.2f}x "
            f"[{lo:.2f}, {hi:.2f}]: {r.get('ratio_verdict', '-')}"
        )
    return "; ".join(parts)


def main_row(res: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The sweep row at the model's main micro-batch."""
    return next((r for r in res.get("sweep", []) if r["batch_size"] == res["main_batch"]), None)


def throughput_markdown(out: Mapping[str, Any]) -> str:
    """README tables of a throughput JSON: per model, the main batch's row per strategy."""
    lines = []
    for m, res in out["models"].items():
        row = main_row(res)
        if row is None:
            continue
        mb = res.get("max_batch", {})
        ample = res.get("ample", {}).get("strategies", {})
        lines += [
            f"**{m}** ({res['num_params'] / 1e6:.1f}M params, {res['weights']}, seq "
            f"{res['seq_len']}, micro-batch {res['main_batch']}, {res['dtype']}): budget "
            f"{res['budget_nbytes'] / MiB:.0f} MiB (smallest feasible {res['min_budget_nbytes'] / MiB:.0f},"
            f" no checkpointing needs {res['no_checkpoint_need_nbytes'] / MiB:.0f}); MILP solve "
            f"{res['solve_ms_median']:.0f} ms (median of 5); profiling {res['profile_s']:.1f} s "
            f"+ planning {res.get('plan_s') or NAN:.1f} s (= "
            f"{res.get('profile_steps_equiv') or NAN:.1f} Adacc steps)",
            "",
            "| strategy | tokens/s (median) | vs HF full (median) | vs HF full (fastest step) "
            "| activations held (MiB) | step peak (MiB) | fits | largest micro-batch |",
            "|---|---:|---:|---:|---:|---:|:-:|---:|",
        ]
        for n, r in row["strategies"].items():
            peak = r.get("peak_nbytes")
            lines.append(
                f"| {r.get('label', n)} | {r.get('tokens_per_s') or NAN:.0f} "
                f"| {r.get('ratio_vs_hf_full') or NAN:.2f} "
                f"| {r.get('ratio_best_vs_hf_full') or NAN:.2f} "
                f"| {r.get('held_nbytes', 0) / MiB:.1f} "
                f"| {peak / MiB if peak else NAN:.1f} "
                f"| {'yes' if r.get('fits') else 'no'} "
                f"| {mb.get(n, {}).get('peak', '-')} |"
            )
        if ample:
            parts = [
                f"{r.get('label', n)} {r.get('ratio_vs_none') or NAN:.2f}x "
                f"(fastest step {r.get('ratio_best_vs_none') or NAN:.2f}x)"
                for n, r in ample.items()
                if n != "none"
            ]
            lines += [
                "",
                f"Memory suffices (budget {res['ample']['budget_nbytes'] / MiB:.0f} MiB): "
                + "; ".join(parts)
                + " of no checkpointing's tokens/s.",
            ]
        by_budget = res.get("max_batch_by_budget", {})
        if len(by_budget) > 1:
            names = list(next(iter(by_budget.values())))
            lines += [
                "",
                "| budget (MiB) | " + " | ".join(names) + " |",
                "|---:|" + "---:|" * len(names),
            ]
            for b, mbs in sorted(by_budget.items(), key=lambda kv: int(kv[0])):
                cells = [str(mbs.get(n, {}).get("peak", "-")) for n in names]
                lines.append(f"| {int(b) / MiB:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def acceptance_markdown(out: Mapping[str, Any]) -> str:
    """Every Adacc row of a throughput JSON (each batch size, and memory sufficing) round by
    round: its tokens/s over the best baseline that fits and its added time against the
    prediction, with intervals and verdicts (`harness.stats`)."""
    lines = [
        "| model | batch | budget (MiB) | strategy | round by round |",
        "|---|---:|---:|---|---|",
    ]
    for m, res in out["models"].items():
        rows = [*res.get("sweep", []), *([res["ample"]] if "ample" in res else [])]
        for row in rows:
            for n, r in row["strategies"].items():
                if "paired_ratio_interval" in r:  # set on budgeted (Adacc) strategies only
                    lines.append(
                        f"| {m} | {row['batch_size']} | {row['budget_nbytes'] / MiB:.0f} "
                        f"| {r.get('label', n)} | {paired(r)} |"
                    )
    return "\n".join(lines)


def print_accuracy(suite: str, res: Mapping[str, Any]) -> None:
    """Final held-out loss per strategy, against the baseline, and seconds per step."""
    print(f"\n[{suite}] {'strategy':22s} {'final eval':>10s} {'vs base':>8s} {'s/step':>7s}")
    for n, r in res["runs"].items():
        pct = r.get("final_eval_vs_baseline_pct", NAN)
        print(
            f"[{suite}] {n:22s} {r['final_eval_loss']:10.4f} {pct:+7.2f}% {r['step_s_median']:7.2f}"
        )
