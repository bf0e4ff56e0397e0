"""The budget GPU check: does a budget hold in the memory CUDA *reserves*, with each case run in a
process of its own? One device call of <= 6 minutes.

    python benchmarks/gpu_suite.py --part budget      # on the GPU: results/budget-<gpu>.json
    python benchmarks/gpu_budget.py --smoke           # the same driver, tiny, on any device

A CUDA run runs out of memory when the allocator's reserved bytes do not fit, not its allocated
ones. The first check measured reserved peaks after other runs in the same process, and switched
to expandable segments late in a process whose cache already held default segments, so its
"expandable" figures measured nothing of the setting. Here every case is a fresh process
(`harness.fresh`): the allocator is set in its environment before CUDA starts (torch's default
or expandable segments), so it starts empty under that setting and ``max_memory_allocated`` /
``max_memory_reserved`` are the case's own. Each case records the allocator's history from its
start (``_record_memory_history``, no stack traces, at most ``max_entries`` entries), dumps it as
``budget-<gpu>-<case>.pickle.gz`` beside the JSON, and replays the trace's own allocation events
through `adacc_hf.devices.caching_allocator` under its allocator: the model's reserved peak
beside the measured one (`harness.budget_case`).

Before the sections, one process reads the device (its name names the files) and its free memory.
Sections, each on its share of the time limit (`SHARES_S`; a case not started inside its
section's share is skipped and listed; a case that fails, runs out of memory or passes its timeout
is recorded and the next runs); the JSON is written after every section:

1. ``profiles``: each model profiled once at 4 x 2048 (bf16, fused AdamW) through
   `adacc_hf.prepare`, alone on the device; its saved profiles are what every case of the model
   plans from (``profile_from``), so the cases differ only in budget and allocator. The budget
   window (the least step peak any policy reaches, no checkpointing's peak) and the predicted
   HF-full / no-checkpointing peaks.
2. ``smollm2``: SmolLM2-135M's config (random init) under ``prepare`` (a custom loop,
   ``session.step_done`` after each step) at fractions 0.1 / 0.4 / 0.8 of the window; HF full
   checkpointing and no checkpointing beside it; each under both allocators, a few steps: the
   allocated and reserved peaks against the plan's predicted peak and the budget, and the
   allocator model's reserved peak from the case's own trace.
3. ``llama``: the 1.1B LLaMA-style config at fractions 0.25 / 0.5, both allocators.
4. ``session``: the first check's custom loop (SmolLM2, lengths 2048, 1536, 2048, 1024, 2048,
   1800 under one session at 0.3 of the window; there 4 of 6 steps reserved over the budget),
   per step, under each allocator.
5. ``free``: a budget set to the card's free memory (``torch.cuda.mem_get_info()[0]`` as the
   process starts) trains where HF full checkpointing trains: the 1.1B at a batch (rows of 2048
   tokens, `free_rows`) whose step without checkpointing would need 1.25x the free memory,
   profiled in the process as a user's first run is, under expandable segments (what
   ``import adacc_hf`` sets), then under torch's default; HF full checkpointing at the same batch
   first.

Cases of sections 2-4 only measure memory, so a few run at once (each process has its own
allocator); profiling and the free-memory cases run alone. ``--smoke`` runs the same driver on a
tiny model on any device (on a CPU nothing CUDA is called, every case still in a process of its
own): profiles, one SmolLM2-section case per allocator, one session, one free-memory case.

On the lent machine, ``$OUT`` gets the JSON after every section, the snapshots in
``budget-<gpu>-snapshots-<n>.tar`` (at most 3, 15 MiB each) and the cases' logs in
``budget-<gpu>-logs-1.tar`` (the tool returns at most 8 files); untar the snapshots into
``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.time()  # before torch is imported: a case reports its imports' share

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
TIME_LIMIT_S = 320  # of the 6 minutes: ~10 s reading the device, ~30 s for the wheels and imports
SECTIONS = ("profiles", "smollm2", "llama", "session", "free")
SMOKE_SECTIONS = ("profiles", "smollm2", "session", "free")
# Each section's share of the limit (GPU), in order; a section may use what earlier ones left.
SHARES_S = {"profiles": 45, "smollm2": 70, "llama": 40, "session": 50, "free": 115}
ALLOCATORS = ("default", "expandable")
SMOL, LLAMA = "smollm2-135m", "llama-1b"
MiB = 2**20


def settings(smoke: bool) -> dict[str, Any]:
    """Sizes of each section: the issue's on a GPU, tiny with ``--smoke``."""
    from adacc_hf.assets import SMOLLM2_CONFIG

    if smoke:
        tiny = dict(SMOLLM2_CONFIG, vocab_size=256, hidden_size=64, intermediate_size=128)
        tiny.update(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        return {
            "models": {SMOL: tiny},
            "dtype": "float32",
            "batch": (2, 32),
            "fractions": {SMOL: [0.4]},
            # (fraction or kind, allocator): one case per allocator
            "smollm2_cases": [(0.4, "default"), ("hf_full", "expandable")],
            "session": ([32, 24, 32], 0.3, ["expandable"]),
            "free": {"model": SMOL, "rows": 2, "cases": [("adacc", "expandable")]},
            "steps": 2,
            "jobs": 2,
            "max_entries": 200_000,
            "timeout_s": 240,
        }
    from benchmarks.harness.models import find_specs

    return {
        "models": {SMOL: dict(SMOLLM2_CONFIG), LLAMA: find_specs("gpu", [LLAMA])[0].config},
        "dtype": "bfloat16",
        "batch": (4, 2048),
        "fractions": {SMOL: [0.1, 0.4, 0.8], LLAMA: [0.25, 0.5]},
        "smollm2_cases": [
            *((f, a) for f in (0.1, 0.4, 0.8) for a in ALLOCATORS),
            *((k, a) for k in ("hf_full", "none") for a in ALLOCATORS),
        ],
        "session": ([2048, 1536, 2048, 1024, 2048, 1800], 0.3, list(ALLOCATORS)),
        # HF full first (the batch it trains at), then the free memory as the budget
        "free": {
            "model": LLAMA,
            "rows": None,  # from the profile: see free_rows
            "cases": [("hf_full", "default"), ("adacc", "expandable"), ("adacc", "default")],
        },
        "steps": 3,
        "jobs": 3,
        "max_entries": 200_000,
        "timeout_s": 200,
    }


def free_rows(profile: dict[str, Any], margin: float = 1.25, hf_share: float = 0.8) -> int:
    """Rows (of the profile's sequence length) at which the step without checkpointing needs
    `margin` x the free memory, as far as HF full checkpointing's predicted peak stays within
    `hf_share` of it: the predicted per-row bytes of both, from the profile's batch."""
    static, rows = profile["static_nbytes"], profile["rows"]
    free = profile["free_nbytes"]
    per_row = {k: (v - static) / rows for k, v in profile["predicted_peak_nbytes"].items()}
    n = math.ceil(margin * (free - static) / per_row["none"])
    n = min(n, math.floor((hf_share * free - static) / per_row["hf_full"]))
    return max(rows, n)


def file_tag(name: str) -> str:
    """The device's name as results files are tagged (`harness.env.device_tag`'s rule)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--tag", default=None, help="file-name tag (default: the device's name)")
    p.add_argument(
        "--time-limit", type=float, default=None, help=f"seconds ({TIME_LIMIT_S}; --smoke: 900)"
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=None)
    p.add_argument("--jobs", type=int, default=None, help="cases at once where they may share")
    p.add_argument("--keep-work", action="store_true", help="keep the cases' specs and logs")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the process it was started in
    args = p.parse_args(argv)
    if args.time_limit is None:  # a smoke run checks the driver: no case skipped on a busy CPU
        args.time_limit = 900.0 if args.smoke else TIME_LIMIT_S
    if args.case:
        from benchmarks.harness.budget_case import main as case_main

        return case_main(args.case, started=STARTED)
    return drive(args, argv)


def drive(args: argparse.Namespace, argv: list[str] | None) -> int:
    import torch  # no CUDA call here: the device is left to the cases' processes

    from benchmarks.harness.env import command_line
    from benchmarks.harness.fresh import run_case
    from benchmarks.harness.report import write_json
    from benchmarks.harness.sections import run_sections

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device here: this check measures a GPU (--smoke runs it tiny)")
        return 2
    cfg = settings(args.smoke)
    sections = args.sections or list(SMOKE_SECTIONS if args.smoke else SECTIONS)
    if "profiles" not in sections:  # every other section plans from the profiles
        sections = ["profiles", *sections]
    sections = [n for n in SECTIONS if n in sections]
    work = Path(tempfile.mkdtemp(prefix="adacc-budget-"))
    if cuda:  # read in a process of its own: this one never starts CUDA
        env = run_case({"name": "env", "kind": "env", "allocator": None}, work, 120)
    else:
        from benchmarks.harness.budget_case import env_case

        env = {"kind": "env"}
        env_case({}, torch.device("cpu"), env)
    gpu = env.get("gpu")
    tag = args.tag or ("smoke" if args.smoke else file_tag(gpu or "gpu"))
    check = Check(cfg, Path(args.results), tag, work, cuda=cuda, jobs=args.jobs or cfg["jobs"])
    out: dict[str, Any] = {
        "suite": "gpu-budget",
        "command": command_line(argv),
        "device": gpu or "CPU",
        "pid": os.getpid(),  # the driver's: every case runs in a process of its own
        "smoke": args.smoke,
        "time_limit_s": args.time_limit,
        "shares_s": SHARES_S,
        "jobs": check.jobs,
        "env": env,
        "settings": {k: v for k, v in cfg.items() if k != "models"},
        "models": cfg["models"],
    }
    print(f"== env: {gpu or 'CPU'}, free {env.get('free_nbytes', 0) / MiB:.0f} MiB", flush=True)
    shares = {n: SHARES_S[n] for n in sections}
    limit = args.time_limit * sum(shares.values()) / TIME_LIMIT_S
    check.start(limit)
    deadline = run_sections(
        sections, shares, limit, check.run, out, check.path,
        after=lambda name, res: check.to_out(out),
    )  # fmt: skip
    sizes = [f.stat().st_size for f in check.snapshots if f.exists()]
    out["snapshot_bytes"] = {"files": len(sizes), "total": sum(sizes), "largest": max(sizes or [0])}
    write_json(check.path, out)
    check.to_out(out)
    print(f"wrote {check.path} ({deadline})", flush=True)
    failed = [c for r in out["sections"].values() for c in r.get("failed", [])]
    if failed:
        print(f"cases that failed (their errors and log tails are in the JSON): {failed}")
    if args.keep_work:
        print(f"cases' specs, results and logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any("error" in r for r in out["sections"].values()) else 0


class Check:
    """The sections' cases: their specs, the profiles they plan from, where their files go."""

    def __init__(
        self, cfg: dict[str, Any], results: Path, tag: str, work: Path, *, cuda: bool, jobs: int
    ) -> None:
        from benchmarks.harness.env import Deadline

        self.cfg, self.results, self.tag, self.work = cfg, results, tag, work
        self.cuda, self.jobs = cuda, jobs
        self.path = results / f"budget-{tag}.json"
        self.profiles: dict[str, dict[str, Any]] = {}  # model -> its profile case's result
        self.snapshots: list[Path] = []
        self.overall = Deadline(None)

    def start(self, limit_s: float) -> None:
        from benchmarks.harness.env import Deadline

        self.overall = Deadline(limit_s)

    def run(self, name: str, share) -> dict[str, Any]:
        """One section (`run_sections`' callback)."""
        if name == "profiles":
            return self.profile_models(share)
        if name == "smollm2":
            return self.planned(SMOL, self.cfg["smollm2_cases"], share)
        if name == "llama":
            cases = [(f, a) for f in self.cfg["fractions"][LLAMA] for a in ALLOCATORS]
            return self.planned(LLAMA, cases, share)
        if name == "session":
            return self.session(share)
        return self.free(share)

    # ------------------------------------------------------------------ sections
    def profile_models(self, share) -> dict[str, Any]:
        cfg = self.cfg
        models = sorted({SMOL, cfg["free"]["model"], *cfg["fractions"]} & set(cfg["models"]))
        specs = {m: self.spec(f"{m}-profile", "profile", m, None, profiles=str(self.work / m))
                 for m in models}  # fmt: skip
        res = self.cases(list(specs.values()), share, 1)
        for m, s in specs.items():
            self.profiles[m] = dict(res[s["name"]], dir=s["profiles"])
        return {"models": {m: res[s["name"]] for m, s in specs.items()}}

    def planned(self, model: str, cases: list[tuple[float | str, str]], share) -> dict[str, Any]:
        """Adacc at fractions of the window, or a baseline (a kind's name), per allocator."""
        short = model.split("-")[0]
        specs = []
        for what, alloc in cases:
            if isinstance(what, str):
                specs.append(self.spec(f"{short}-{what}-{alloc}", what, model, alloc))
            else:
                specs.append(
                    self.spec(
                        f"{short}-adacc-f{what:g}-{alloc}", "adacc", model, alloc,
                        budget=self.budget(model, what), fraction=what,
                        profiles=self.profiles[model]["dir"],
                    )
                )  # fmt: skip
        return self.section(model, self.cases(specs, share, self.jobs))

    def session(self, share) -> dict[str, Any]:
        lengths, fraction, allocs = self.cfg["session"]
        specs = [
            self.spec(
                f"smollm2-session-{a}", "session", SMOL, a, lengths=lengths, steps=len(lengths),
                budget=self.budget(SMOL, fraction), fraction=fraction,
                profiles=self.profiles[SMOL]["dir"], max_entries=2 * self.cfg["max_entries"],
            )
            for a in allocs
        ]  # fmt: skip
        return self.section(SMOL, self.cases(specs, share, min(self.jobs, 2)))

    def free(self, share) -> dict[str, Any]:
        """Alone on the device: the free memory is what the budget reads."""
        free = self.cfg["free"]
        model = free["model"]
        rows = free["rows"] or free_rows(self.profiles[model])
        short = model.split("-")[0]
        specs = [
            self.spec(f"{short}-free-{k}-b{rows}-{a}", k, model, a, rows=rows, budget="free",
                      max_entries=2 * self.cfg["max_entries"])
            for k, a in free["cases"]
        ]  # fmt: skip
        timeout = self.cfg["timeout_s"] + 60  # profiled in the process, at a large batch
        return dict(self.section(model, self.cases(specs, share, 1, timeout)), rows=rows)

    # ------------------------------------------------------------------ pieces
    def spec(self, name: str, kind: str, model: str, allocator: str | None, **kw: Any) -> dict:
        rows, seq = self.cfg["batch"]
        s = {
            "name": name, "kind": kind, "allocator": allocator, "model": self.cfg["models"][model],
            "dtype": self.cfg["dtype"], "rows": rows, "seq": seq, "steps": self.cfg["steps"],
            "max_entries": self.cfg["max_entries"],
        }  # fmt: skip
        if self.cuda and kind != "profile":
            s["snapshot"] = str(self.results / f"budget-{self.tag}-{name}.pickle.gz")
        return {**s, **kw}

    def budget(self, model: str, fraction: float) -> int:
        """`fraction` of the way from the least step peak to no checkpointing's (the profile's)."""
        prof = self.profiles.get(model)
        if not prof or "window" not in prof:
            raise RuntimeError(f"no budget window for {model}: its profile did not run")
        lo, hi = prof["window"]
        return int(lo + fraction * (hi - lo))

    def cases(self, specs: list[dict], share, jobs: int, timeout: float | None = None) -> dict:
        from benchmarks.harness.fresh import run_cases

        res = run_cases(
            specs, self.work, jobs=jobs, share=share, overall=self.overall,
            timeout_s=timeout or self.cfg["timeout_s"], report=_report,
        )  # fmt: skip
        for r in res.values():
            _compare(r)
            if (r.get("snapshot") or {}).get("file"):
                self.snapshots.append(self.results / r["snapshot"]["file"])
        return res

    def section(self, model: str, res: dict[str, Any]) -> dict[str, Any]:
        prof = self.profiles.get(model, {})
        return {
            "model": model,
            "window": prof.get("window"),
            "predicted_peak_nbytes": prof.get("predicted_peak_nbytes"),
            "cases": res,
            "skipped": [n for n, r in res.items() if "skipped" in r],
            "failed": [n for n, r in res.items() if "error" in r],
        }

    def to_out(self, out: dict[str, Any]) -> None:
        """On the lent machine: the JSON, the snapshots and the logs into ``$OUT`` (the tool
        returns at most 8 files of 16 MiB, 64 MiB in all: the snapshots go in up to 3 tars of
        15 MiB, the logs in one)."""
        from benchmarks.harness.fresh import bundle
        from benchmarks.harness.report import write_json

        if not os.environ.get("OUT"):
            return
        dest = Path(os.environ["OUT"])
        kept = [f for f in self.snapshots if f.exists()]
        stem = f"budget-{self.tag}"
        out["bundled"] = bundle(kept, dest, f"{stem}-snapshots", max_bytes=15 * MiB, max_parts=3)
        logs = sorted(self.work.glob("*.log"))
        bundle(logs, dest, f"{stem}-logs", max_bytes=15 * MiB, max_parts=1)
        write_json(dest / self.path.name, out)


def _compare(r: dict[str, Any]) -> None:
    """The allocator model's reserved peak against the case's measured one."""
    snap, measured = r.get("snapshot") or {}, r.get("reserved_peak_nbytes")
    modelled = snap.get("modelled_reserved_peak_nbytes")
    if modelled and measured:
        r["modelled_vs_measured_reserved"] = modelled / measured - 1


def _report(name: str, r: dict[str, Any]) -> None:
    def mib(v: Any) -> str:
        return "-" if not isinstance(v, (int, float)) else f"{v / MiB:.1f}"

    if "skipped" in r:
        print(f"  {name:38s} skipped ({r['skipped']})", flush=True)
        return
    snap = r.get("snapshot") or {}
    pred = r.get("predicted_peak_nbytes")
    line = (
        f"  {name:38s} rc {r.get('returncode')} {r.get('wall_s', 0):5.1f} s: allocated "
        f"{mib(r.get('allocated_peak_nbytes'))} reserved {mib(r.get('reserved_peak_nbytes'))} "
        f"budget {mib(r.get('budget_nbytes'))} predicted "
        f"{mib(pred if not isinstance(pred, dict) else None)} modelled "
        f"{mib(snap.get('modelled_reserved_peak_nbytes'))} MiB"
    )
    if r.get("reserved_within_budget") is False:
        line += " RESERVED OVER BUDGET"
    if any(s.get("oom") for s in r.get("steps", [])) or r.get("oom"):
        line += " OUT OF MEMORY"
    if "error" in r:
        line += f" ERROR {r['error'][:200]}"
    print(line, flush=True)
    if r.get("returncode") and r.get("log_tail"):
        print("    " + r["log_tail"].replace("\n", "\n    ")[-1500:], flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
