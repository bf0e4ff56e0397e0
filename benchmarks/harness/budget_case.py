"""One case of the budget GPU check (`benchmarks/gpu_budget.py`), run in a process of its own.

The driver starts ``python benchmarks/gpu_budget.py --case SPEC.json`` once per case, with the
allocator chosen in the environment before CUDA starts (``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``, or ``ADACC_CUDA_ALLOCATOR=default`` for torch's default: see
`harness.fresh`). CUDA's caching allocator then starts empty under that setting, and the
process's own statistics are the case's: ``max_memory_allocated`` / ``max_memory_reserved`` over
the whole process (building the model and planning included) and per step (reset as each step
starts).

Kinds (``spec["kind"]``):

* ``env``: the device, its free memory, versions; no model.
* ``profile``: profile the model at its batch through `adacc_hf.prepare` and save the profiles
  (an ``adacc_profiles.json``) for the model's cases to plan from: one profile, measured with the
  device to itself, for every budget. Returns the budget window (the least step peak any policy
  reaches, no checkpointing's peak) and the predicted HF-full and no-checkpointing peaks.
* ``adacc``: a custom loop under ``prepare(model, budget, batch, optimizer=opt, adaptive=True)``
  planned from those profiles, ``session.step_done`` after every step as a user's loop calls it.
  ``budget: "free"``: the device's free memory as the process starts
  (``torch.cuda.mem_get_info()[0]``; on a CPU the host's available memory), planned from a
  profile made in the process, as a user's first run is.
* ``session``: the same on batches of several lengths (each new length a bucket of its own).
* ``hf_full`` / ``none``: transformers' own checkpointing (non-reentrant) / no checkpointing.

On CUDA the allocator's history is recorded from the process's start (``context=None``: no stack
traces, and no ``free_requested`` entries where torch can skip them: the model reads
``free_completed``; so the file stays small; at most ``max_entries`` entries, the oldest dropped
first),
pickled and gzipped to ``spec["snapshot"]`` (what ``torch.cuda.memory._dump_snapshot`` writes,
compressed), and its own allocation events replayed through `adacc_hf.devices.caching_allocator`
under the case's allocator: the model's reserved peak beside the measured one. An out-of-memory
error ends the steps and is recorded; the snapshot is still written (it holds the ``oom`` event).
On a CPU nothing CUDA is called: each step's allocated peak is measured by
`adacc_hf.measure_step_peak` instead.
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import json
import os
import pickle
import platform
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .report import MiB, write_json

#: The environment variables that choose CUDA's allocator (recorded by every case).
ALLOCATOR_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ADACC_CUDA_ALLOCATOR")


def main(spec_path: str, started: float | None = None) -> int:
    """Run the case of `spec_path` and write its result JSON (``spec["result"]``); 1 on error.
    `started`: the process's start (``time.time()``), for the seconds its imports took."""
    spec = json.loads(Path(spec_path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the CPU benchmarks; the profile's fingerprint names it
    res: dict[str, Any] = {
        "case": spec["name"],
        "kind": spec["kind"],
        "allocator": spec.get("allocator"),
        "pid": os.getpid(),
        "environment": {v: os.environ.get(v) for v in ALLOCATOR_VARS},
    }
    if started is not None:
        res["started_s"] = time.time() - started  # Python and torch's imports
    t0 = time.perf_counter()
    rc = 0
    try:
        KINDS[spec["kind"]](spec, device, res)  # fills `res` as it goes
    except Exception as e:  # recorded: the driver reads the result, not the exit code alone
        traceback.print_exc()
        res.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        if device.type == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError):
            res["oom"] = True
        rc = 1
    res["seconds"] = time.perf_counter() - t0
    write_json(spec["result"], res)
    return rc


# ---------------------------------------------------------------------------- the kinds
def env_case(spec: Mapping[str, Any], device: torch.device, out: dict[str, Any]) -> None:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "transformers", "accelerate", "triton", "PuLP"):
        try:
            versions[name.lower()] = md.version(name)
        except md.PackageNotFoundError:
            versions[name.lower()] = None
    out.update(python=platform.python_version(), versions=versions)
    out["free_nbytes"] = free_nbytes(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            gpu=props.name,
            total_nbytes=props.total_memory,
            capability=list(torch.cuda.get_device_capability(device)),
        )


def profile_case(spec: Mapping[str, Any], device: torch.device, out: dict[str, Any]) -> None:
    from adacc_hf import prepare, uniform_policy
    from adacc_hf.engine.saved import PROFILES_FILE
    from adacc_hf.solver import predict

    from .adacc import budget_range

    free = free_nbytes(device)
    model, opt, static = build(spec, device)
    batch = make_batch(model, spec["rows"], spec["seq"])
    user_peak = None
    if device.type == "cuda":  # a user's peak statistic, set high before profiling
        torch.empty(int(0.6 * free_nbytes(device)), dtype=torch.uint8, device=device)
        user_peak = torch.cuda.max_memory_allocated(device)
    t0 = time.perf_counter()
    session = prepare(model, free, batch, optimizer=opt, adaptive=False)
    profile_s = time.perf_counter() - t0
    if user_peak is not None:  # profiling resets nobody's statistics (issue 52)
        out["user_peak_kept"] = torch.cuda.max_memory_allocated(device) == user_peak
    path = Path(spec["profiles"])
    path.mkdir(parents=True, exist_ok=True)
    with open(path / PROFILES_FILE, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(p.to_json() for p in session.profiles.values()) + "\n]\n")
    profile = session.profile
    session.close()
    lo, hi = budget_range(profile, static)
    predicted = {
        name: predict(profile, uniform_policy(model, action, batch), static).peak_nbytes
        for name, action in (("hf_full", "recompute"), ("none", "retain"))
    }
    print(
        f"[{spec['name']}] profiled in {profile_s:.1f} s; window {lo / MiB:.1f}-{hi / MiB:.1f} "
        f"MiB; predicted HF full {predicted['hf_full'] / MiB:.1f}, none "
        f"{predicted['none'] / MiB:.1f} MiB",
        flush=True,
    )
    out.update(
        rows=spec["rows"],
        seq=spec["seq"],
        profile_s=profile_s,
        free_nbytes=free,
        static_nbytes=static.total,
        window=[lo, hi],
        predicted_peak_nbytes=predicted,
    )


def adacc_case(spec: Mapping[str, Any], device: torch.device, out: dict[str, Any]) -> None:
    from adacc_hf import prepare

    with recorded(spec, device, out):
        free = free_nbytes(device)
        budget = free if spec["budget"] == "free" else int(spec["budget"])
        out.update(free_at_start_nbytes=free, budget_nbytes=budget)
        model, opt, _ = build(spec, device)
        lengths = spec.get("lengths") or [spec["seq"]]
        batches = [make_batch(model, spec["rows"], n, seed=i) for i, n in enumerate(lengths)]
        sample = batches[lengths.index(max(lengths))]
        meter = Meter(device)
        t0 = time.perf_counter()
        saved = {"profile_from": spec["profiles"]} if spec.get("profiles") else {}
        session = prepare(model, budget, sample, optimizer=opt, adaptive=True, **saved)
        out.update(
            plan_s=time.perf_counter() - t0,
            setup=meter.window(),
            summary=session.policy.summary(),
            predicted_peak_nbytes=_predicted(session),
        )
        out["steps"] = run_steps(
            model, [batches[i % len(batches)] for i in range(spec["steps"])], opt, meter,
            session=session, name=spec["name"], budget=budget, measure=len(lengths) == 1,
        )  # fmt: skip
        out["events"] = [
            {"step": e.step, "kind": e.kind, "message": e.message} for e in session.events
        ]
        out["guard_replans"] = session.guard.replans
        out.update(meter.totals(budget))
        session.close()


def baseline_case(spec: Mapping[str, Any], device: torch.device, out: dict[str, Any]) -> None:
    from .patching import hf_enable

    with recorded(spec, device, out):
        budget = spec.get("budget")
        if budget == "free":  # beside a case whose budget is the free memory
            budget = out["free_at_start_nbytes"] = free_nbytes(device)
        model, opt, _ = build(spec, device)
        if spec["kind"] == "hf_full":
            hf_enable(model, offload=False)
        batch = make_batch(model, spec["rows"], spec["seq"])
        meter = Meter(device)
        out["setup"] = meter.window()
        out["steps"] = run_steps(
            model, [batch] * spec["steps"], opt, meter, name=spec["name"], budget=budget
        )
        out.update(meter.totals(budget))


KINDS: dict[str, Callable[[Mapping[str, Any], torch.device, dict[str, Any]], None]] = {
    "env": env_case,
    "profile": profile_case,
    "adacc": adacc_case,
    "session": adacc_case,
    "hf_full": baseline_case,
    "none": baseline_case,
}


# ---------------------------------------------------------------------------- pieces
def free_nbytes(device: torch.device) -> int:
    """The device's free memory now (CUDA: ``mem_get_info``); on a CPU the host's available
    memory (``MemAvailable``), the stand-in a CPU run plans with."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build(spec: Mapping[str, Any], device: torch.device):
    """The LLaMA-style model of ``spec["model"]`` made on `device` in ``spec["dtype"]`` (random
    init, seeded: no float32 copy passes through the device's allocator), in train mode, with
    its AdamW (fused on CUDA) and the static memory the solver counts for them."""
    import transformers

    from adacc_hf import estimate_static_memory

    torch.manual_seed(spec.get("seed", 0))
    config = transformers.LlamaConfig(**spec["model"], use_cache=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, spec["dtype"]))
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
    static = estimate_static_memory(
        model, optimizer="adamw_torch_fused" if fused else "adamw_torch"
    )
    return model, opt, static


def make_batch(model, rows: int, seq: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (rows, seq), generator=gen)
    ids = ids.to(next(model.parameters()).device)
    return {"input_ids": ids, "labels": ids}


class Meter:
    """The allocator's peaks in windows (reset as each starts), and the process's: the highest
    of every window (on CUDA; nothing is read on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.allocated = 0
        self.reserved = 0

    def window(self) -> dict[str, int | None]:
        """The peaks since the last window (or the process's start), then a new window."""
        if not self.cuda:
            return {"allocated_peak_nbytes": None, "reserved_peak_nbytes": None}
        a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        self.allocated, self.reserved = max(self.allocated, a), max(self.reserved, r)
        torch.cuda.reset_peak_memory_stats()
        return {"allocated_peak_nbytes": a, "reserved_peak_nbytes": r}

    def add(self, allocated: int | None) -> None:
        """A peak measured otherwise (a CPU step's)."""
        if allocated is not None:
            self.allocated = max(self.allocated, allocated)

    def totals(self, budget: int | None) -> dict[str, Any]:
        """The process's peaks (the last window included) against `budget`."""
        self.window()
        reserved = self.reserved if self.cuda else None
        out: dict[str, Any] = {
            "allocated_peak_nbytes": self.allocated or None,
            "reserved_peak_nbytes": reserved,
        }
        if budget:
            out["allocated_within_budget"] = self.allocated <= budget if self.allocated else None
            out["reserved_within_budget"] = None if reserved is None else reserved <= budget
        return out


def _predicted(session) -> int | None:
    return session.policy.metadata.get("predicted", {}).get("peak_nbytes")


def run_steps(
    model,
    batches: list[dict[str, Any]],
    opt: torch.optim.Optimizer,
    meter: Meter,
    *,
    session=None,
    name: str,
    budget: int | None = None,
    measure: bool = True,
) -> list[dict[str, Any]]:
    """Train on `batches` (one optimizer step each) as a custom loop does, ``step_done`` after each
    step when there is a session; one row per step. An out-of-memory error ends the loop. On a
    CPU with `measure`, each step runs under `adacc_hf.measure_step_peak` (its allocated peak)."""
    from adacc_hf import measure_step_peak

    oom = torch.cuda.OutOfMemoryError if meter.cuda else ()  # not `harness.memory`'s: lighter
    rows = []
    for step, batch in enumerate(batches, start=1):
        row: dict[str, Any] = {"seq_len": int(batch["input_ids"].shape[1])}
        t0 = time.perf_counter()
        try:
            if measure and not meter.cuda:  # no allocator statistics: its live storages
                peak = measure_step_peak(model, batch, opt).peak_nbytes
                meter.add(peak)
                row["allocated_peak_nbytes"] = peak
            else:  # (a session's new bucket profiles inside the forward: no profiler around it)
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                row["loss"] = float(loss.detach())
                del loss
        except oom as e:
            row.update(oom=True, error=str(e).splitlines()[0])
            opt.zero_grad(set_to_none=True)
        row["seconds"] = time.perf_counter() - t0
        if meter.cuda:
            row.update(meter.window(), reserved_after_nbytes=torch.cuda.memory_reserved())
        if session is not None:
            row["predicted_peak_nbytes"] = _predicted(session)
            if not row.get("oom"):
                event = session.step_done(step)
                row["event"] = event.kind if event is not None else None
        if budget and row.get("reserved_peak_nbytes") is not None:
            row["reserved_over_budget_nbytes"] = row["reserved_peak_nbytes"] - budget
        rows.append(row)
        print(f"[{name}] step {step}: {_step_line(row, budget)}", flush=True)
        if row.get("oom"):
            break
    return rows


def _step_line(row: Mapping[str, Any], budget: int | None) -> str:
    def mib(key: str) -> str:
        v = row.get(key)
        return "-" if v is None else f"{v / MiB:.1f}"

    b = f" budget {budget / MiB:.1f}" if budget else ""
    oom = " OUT OF MEMORY" if row.get("oom") else ""
    return (
        f"len {row['seq_len']} allocated {mib('allocated_peak_nbytes')} reserved "
        f"{mib('reserved_peak_nbytes')} predicted {mib('predicted_peak_nbytes')}{b} MiB, "
        f"{row['seconds']:.2f} s{oom}"
    )


@contextlib.contextmanager
def recorded(spec: Mapping[str, Any], device: torch.device, out: dict[str, Any]) -> Iterator[None]:
    """Record CUDA's allocator history through the block; then dump it to ``spec["snapshot"]``
    and replay it through the allocator model (``out["snapshot"]``). Nothing on a CPU."""
    path = spec.get("snapshot")
    if device.type != "cuda" or not path:
        yield
        return
    record = torch.cuda.memory._record_memory_history
    kw: dict[str, Any] = {"max_entries": int(spec["max_entries"]), "context": None}
    if "skip_actions" in inspect.signature(record).parameters:  # where this torch has it
        kw["skip_actions"] = ["free_requested"]  # the model reads free_completed
    record(**kw)
    try:
        yield
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["snapshot"] = snapshot_row(snap, Path(path), spec.get("allocator") == "expandable")


def snapshot_row(snap: Mapping[str, Any], path: Path, expandable: bool) -> dict[str, Any]:
    """Write `snap` to `path` (pickled, gzipped) and replay its own allocation events through
    the caching-allocator model under the case's allocator setting."""
    from adacc_hf.devices.allocations import load_snapshot
    from adacc_hf.devices.caching_allocator import replay

    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as f:
        pickle.dump(snap, f)
    traces = snap.get("device_traces") or [[]]
    row: dict[str, Any] = {
        "file": path.name,
        "bytes": path.stat().st_size,
        "trace_entries": len(traces[0]),
    }
    try:
        s = load_snapshot(snap)
        t0 = time.perf_counter()
        peaks = replay(s.events, expandable=expandable, **s.options)
        row.update(
            events=len(s.events),
            complete=s.complete,
            expandable_in_trace=s.expandable,
            options=s.options,
            reserved_at_trace_start_nbytes=s.reserved_start,
            traced_reserved_peak_nbytes=s.reserved_peak,
            modelled_reserved_peak_nbytes=peaks.reserved,
            modelled_allocated_peak_nbytes=peaks.allocated,
            modelled_vs_traced=peaks.reserved / s.reserved_peak - 1 if s.reserved_peak else None,
            replay_s=time.perf_counter() - t0,
        )
    except Exception as e:  # the measured figures stand without the model's
        row["replay_error"] = f"{type(e).__name__}: {e}"
    return row
