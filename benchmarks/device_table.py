"""Build the committed device tables (``src/adacc_hf/devices/tables/<name>.json``) from the GPU
runs in ``benchmarks/results/``: copy bandwidth and each codec backend's encode / decode times
from the first check's ``codecs`` section (and ``--part codecs``'s, where committed), the host
link from the offload check, the efficiencies calibrated on the device's own step times
(`adacc_hf.devices.calibrate`).

    python benchmarks/device_table.py            # every device with committed runs
    python benchmarks/device_table.py --no-fit   # measured figures only, efficiencies kept

Nothing here is typed by hand but the datasheet's dense bf16 matmul throughput (`DATASHEET`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
TABLES = ROOT / "src" / "adacc_hf" / "devices" / "tables"

#: name -> (results tag, label, dense bf16 TFLOP/s from the vendor's datasheet, SXM parts)
DATASHEET = {
    "h100": ("nvidia-h100-80gb-hbm3", "NVIDIA H100 80GB HBM3", 989.4),
    "h200": ("nvidia-h200", "NVIDIA H200", 989.4),
}


def _codec_rows(rows: list[dict], out: dict) -> None:
    """codec -> backend -> size -> [encode, decode] ms from a codecs section's rows: the Triton
    kernels' and the torch reference's times (the first check), or each backend's (``backend``
    rows of ``--part codecs``)."""
    for r in rows:
        size = str(r["size_mb"]).removesuffix(".0")
        if "backend" in r:
            pairs = [(r["backend"], r["encode_ms"], r["decode_ms"])]
        else:
            pairs = [("triton", r["encode_ms"], r["decode_ms"])]
            if r.get("ref_encode_ms") is not None:
                pairs.append(("torch", r["ref_encode_ms"], r["ref_decode_ms"]))
        for backend, enc, dec in pairs:
            if enc is not None and dec is not None:
                out.setdefault(r["codec"], {}).setdefault(backend, {})[size] = [enc, dec]


def measured_prior(device: dict, tflops: float) -> dict:
    """What the codecs check measured of the device itself, as the fit's prior: the best matmul
    and the fused attention's throughput against the datasheet's, the host's costs."""
    from adacc_hf.devices.table import DEFAULT_EFFICIENCY

    prior = dict(DEFAULT_EFFICIENCY)
    if device.get("matmul"):
        prior["matmul"] = max(r["tflops"] for r in device["matmul"]) / tflops
    if device.get("attention"):
        rates = [
            (r["forward_tflops"] + 2.5 * r["backward_tflops"]) / 3.5 for r in device["attention"]
        ]
        prior["attention"] = sum(rates) / len(rates) / tflops
    host = device.get("host") or {}
    if host.get("op_us"):
        prior["host_op_us"] = host["op_us"]
    if host.get("mode_crossing_us"):
        prior["host_mode_us"] = max(1.0, host["mode_crossing_us"])
    return prior


def build(name: str) -> dict:
    """The measured part of device `name`'s table, read from the committed results."""
    tag, label, tflops = DATASHEET[name]
    first = json.loads((RESULTS / f"first-{tag}.json").read_text())
    sections = first["sections"]
    table: dict = {
        "name": name,
        "label": label,
        "memory_gib": sections["env"]["memory_gib"],
        "matmul_tflops": tflops,
        "copy_gbps": {str(k): v for k, v in sections["codecs"]["copy_gbps"].items()},
        "codecs": {},
        "sources": [f"benchmarks/results/first-{tag}.json"],
    }
    _codec_rows(sections["codecs"]["rows"], table["codecs"])
    codecs = RESULTS / f"codecs-{tag}.json"
    if codecs.exists():  # --part codecs: every backend, measured later than the first check
        part = json.loads(codecs.read_text()).get("sections", {})
        _codec_rows(part.get("codecs", {}).get("rows", []), table["codecs"])
        table["prior"] = measured_prior(part.get("device", {}), tflops)
        table["sources"].append(f"benchmarks/results/codecs-{tag}.json")
    offload = RESULTS / f"offload-{tag}.json"
    if offload.exists():
        link = json.loads(offload.read_text())["link"]
        table["link"] = {k: link[k] for k in ("d2h_gbps", "h2d_gbps", "launch_ms")}
        table["sources"].append(f"benchmarks/results/offload-{tag}.json")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="*", default=sorted(DATASHEET))
    p.add_argument("--no-fit", action="store_true", help="keep the tables' efficiencies")
    args = p.parse_args(argv)
    from adacc_hf.devices.table import DeviceTable

    TABLES.mkdir(parents=True, exist_ok=True)
    for name in args.devices:
        path = TABLES / f"{name}.json"
        old = DeviceTable.from_json(path.read_text()) if path.exists() else None
        table = DeviceTable(**build(name))
        if old is not None and args.no_fit:
            table = table.with_efficiency(old.efficiency, old.calibrated_on)
        elif not args.no_fit:  # fitted from the prior, not from an earlier fit
            table = table.with_efficiency(dict(table.prior), [])
        if not args.no_fit:
            from adacc_hf.devices.calibrate import fit, simulate
            from benchmarks.harness.device_runs import committed_runs

            runs = [r for r in committed_runs(name) if r.step_ms]
            eff, err = fit(table, simulate(runs, table))
            table = table.with_efficiency(eff, [r.name for r in runs])
            print(f"{name}: fitted on {len(runs)} runs, largest error {err:.1%}: {eff}")
        path.write_text(table.to_json() + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
