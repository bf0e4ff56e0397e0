"""The plan a GPU gets, made on this CPU, held to what the GPUs measured.

For each pair of lent devices (H100 <-> H200): the table of one is fitted on its own committed
runs (`adacc_hf.devices.calibrate.fit`), its efficiencies given to the other's table, and every
committed run of the other simulated on paper with them (`plan_for_device`: the same profile,
solve and dry step a run makes). Printed and written per run: the modelled step time and
allocated peak against the GPU's, and the plan's summary beside the GPU's.

    python benchmarks/device_check.py                       # both directions, ~10 min on 2 cores
    python benchmarks/device_check.py --fit-on h200 --check h100
    python benchmarks/device_check.py --smoke               # one tiny run (the driver, seconds)

Writes ``results/device-check-cpu.json``. The bars (issue 51): every step time within 10 %,
every allocated peak within 2 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf.devices.calibrate import Run, Setting, fit, simulate  # noqa: E402
from adacc_hf.devices.table import load_device  # noqa: E402
from benchmarks.harness.device_runs import committed_runs  # noqa: E402

TIME_BAR, PEAK_BAR = 0.10, 0.02


def _row(o) -> dict:
    err = o.errors()
    return {
        "run": o.run.name,
        "strategy": o.run.strategy,
        "budget_nbytes": o.run.budget_nbytes,
        "measured_step_ms": o.run.step_ms,
        "modelled_step_ms": round(o.step_ms, 2),
        "predicted_step_ms": round(o.predicted_step_ms, 2) if o.predicted_step_ms else None,
        "step_error": round(err["step_ms"], 4) if "step_ms" in err else None,
        "measured_peak_nbytes": o.run.peak_nbytes,
        "modelled_peak_nbytes": o.peak_nbytes,
        "predicted_peak_nbytes": o.predicted_peak_nbytes,
        "peak_error": round(err["peak_nbytes"], 4) if "peak_nbytes" in err else None,
        "plan": o.summary,
    }


def direction(fit_on: str, check: str) -> dict:
    """Fit `fit_on`'s table on its runs, check `check`'s runs with those efficiencies."""
    t0 = time.perf_counter()
    own = load_device(fit_on)
    fitted, worst = fit(own, simulate(committed_runs(fit_on), own))
    print(f"fitted on {fit_on}: largest time error there {worst:.1%}; {fitted}", flush=True)
    other = load_device(check).with_efficiency(fitted, [f"{fit_on} committed runs"])
    rows = [_row(o) for o in simulate(committed_runs(check), other)]
    for r in rows:
        t = f"{r['step_error']:+.1%}" if r["step_error"] is not None else "  -  "
        p = f"{r['peak_error']:+.2%}" if r["peak_error"] is not None else "  -  "
        print(f"  {r['run']:40s} time {t:>7s}  peak {p:>7s}  {r['plan']}", flush=True)
    times = [abs(r["step_error"]) for r in rows if r["step_error"] is not None]
    peaks = [abs(r["peak_error"]) for r in rows if r["peak_error"] is not None]
    return {
        "fit_on": fit_on,
        "check": check,
        "efficiency": fitted,
        "fit_worst_time_error": worst,
        "rows": rows,
        "worst_time_error": max(times, default=None),
        "worst_peak_error": max(peaks, default=None),
        "time_bar_holds": all(t <= TIME_BAR for t in times),
        "peak_bar_holds": all(p <= PEAK_BAR for p in peaks),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def smoke() -> dict:
    """A tiny LLaMA, no checkpointing and HF full on the H200 table: the driver works."""
    s = Setting(
        "tiny",
        "llama",
        (
            ("hidden_size", 64),
            ("intermediate_size", 128),
            ("num_attention_heads", 4),
            ("num_hidden_layers", 2),
            ("num_key_value_heads", 2),
            ("vocab_size", 256),
        ),
        2,
        64,
    )
    runs = [
        Run("smoke/none", "h200", s, "none", 1.0, None),
        Run("smoke/hf_full", "h200", s, "hf_full", 1.2, None),
    ]
    out = simulate(runs, load_device("h200"))
    return {"rows": [_row(o) for o in out]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit-on", help="fit on this device only (default: both directions)")
    p.add_argument("--check", help="check this device (with --fit-on)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device-check-cpu.json"))
    args = p.parse_args(argv)
    if args.smoke:
        print(json.dumps(smoke(), indent=1))
        return 0
    pairs = [(args.fit_on, args.check)] if args.fit_on else [("h100", "h200"), ("h200", "h100")]
    res = {"command": "python benchmarks/device_check.py", "directions": []}
    for a, b in pairs:
        res["directions"].append(direction(a, b))
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    ok = all(d["time_bar_holds"] and d["peak_bar_holds"] for d in res["directions"])
    print(f"wrote {args.out}; bars {'hold' if ok else 'do not hold'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
