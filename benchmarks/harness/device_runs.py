"""The step times and peaks the GPUs measured, read from the committed results as
`adacc_hf.devices.calibrate.Run`s: what the device tables are fitted on and checked against.

* ``first-<gpu>.json``: the 1.1B LLaMA config, 4 x 2048, bf16, fused AdamW: no checkpointing, HF
  full checkpointing and Adacc at a quarter of the budget window (step times and allocated
  peaks); SmolLM2's config, 4 x 2048: the peaks of no checkpointing, HF full and Adacc at three
  budgets (not timed).
* ``offload-<gpu>.json``: SmolLM2's config, 1 x 16384: HF full checkpointing and Adacc with the
  chunked head, with and without offload, at two budgets (step times from tokens/s, peaks).

What is left out: transformers' ``offload=True`` (not a plan this library makes), the compiled
runs (a dry run prices eager kernels), the custom loop's steps (they include planning).
"""

from __future__ import annotations

import json
from pathlib import Path

from adacc_hf.devices.calibrate import Run, Setting
from adacc_hf.runtime.timing import BLOCK_TIMING

from .models import SMOLLM2_CONFIG, find_specs

RESULTS = Path(__file__).resolve().parents[1] / "results"
TAGS = {"h100": "nvidia-h100-80gb-hbm3", "h200": "nvidia-h200"}
#: The offload check ran the chunked head in chunks of 8 MiB of logits on the GPU (the CPU's
#: size; the GPU's is larger since): it is simulated as it ran.
OFFLOAD_RUN_CHUNK_NBYTES = 8 * 2**20


def _synchronised(results: dict) -> bool:
    """Whether the run's profiler timed a block synchronised, alone: results recorded before it
    timed blocks among blocks (`runtime.timing.BLOCK_TIMING`, where a GPU's host runs ahead)
    name no timing; their plans are made again as their code made them."""
    return results.get("block_timing") != BLOCK_TIMING


def _setting(name: str, batch: int, seq_len: int) -> Setting:
    if name == "smollm2-135m":
        return Setting(name, "llama", tuple(sorted(SMOLLM2_CONFIG.items())), batch, seq_len)
    spec = find_specs("gpu", [name])[0]
    return Setting(name, spec.family, tuple(sorted(spec.config.items())), batch, seq_len)


def committed_runs(device: str) -> list[Run]:
    """Every committed run of `device` (``h100``, ``h200``) the paper model can be held to."""
    tag = TAGS[device]
    runs: list[Run] = []
    first = RESULTS / f"first-{tag}.json"
    if first.exists():
        data = json.loads(first.read_text())
        sections, synchronised = data["sections"], _synchronised(data)
        t = sections.get("throughput")
        if t:
            s = _setting(t["model"], t["batch"], t["seq_len"])
            for name, row in t["strategies"].items():
                runs.append(
                    Run(
                        f"{device}/first/{t['model']}/{name}",
                        device,
                        s,
                        name,
                        row.get("step_ms_median"),
                        row.get("peak_nbytes"),
                        t["budget_nbytes"] if name == "adacc" else None,
                        synchronised_blocks=synchronised,
                    )
                )
        p = sections.get("peaks")
        if p:
            s = _setting(p["model"], p["batch"], p["seq_len"])
            for name, row in p["baselines"].items():
                runs.append(
                    Run(f"{device}/peaks/{name}", device, s, name, None, row["peak_nbytes"])
                )
            for row in p["budgets"]:
                runs.append(
                    Run(
                        f"{device}/peaks/adacc-{row['fraction']}",
                        device,
                        s,
                        "adacc",
                        None,
                        row["peak_nbytes"],
                        row["budget_nbytes"],
                        synchronised_blocks=synchronised,
                    )
                )
    offload = RESULTS / f"offload-{tag}.json"
    if offload.exists():
        d = json.loads(offload.read_text())
        synchronised = _synchronised(d)
        s = _setting(d["model"], 1, d["lengths"][1])
        tokens = d["lengths"][1]
        for name in ("hf_full", "adacc_offload", "adacc_no_offload", "adacc_offload_tight"):
            peak = d["peaks"].get(name, {})
            tps = d["tokens_per_s"].get(name)
            plan = d.get(name, {})
            runs.append(
                Run(
                    f"{device}/offload/{name}",
                    device,
                    s,
                    "hf_full" if name == "hf_full" else "adacc",
                    tokens / tps * 1e3 if tps else None,
                    peak.get("peak_nbytes"),
                    plan.get("budget_nbytes"),
                    head="chunked",
                    offload=name != "adacc_no_offload",
                    gpu_chunk_nbytes=OFFLOAD_RUN_CHUNK_NBYTES,
                    synchronised_blocks=synchronised,
                )
            )
    return runs
