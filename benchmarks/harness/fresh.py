"""Cases run each in a fresh process, so CUDA's caching allocator starts empty under the setting
the case asks for (the budget GPU check, `benchmarks/gpu_budget.py`).

A reserved-memory figure measured after other runs in the same process carries their cached
segments, and an allocator setting switched mid-process applies only to segments made afterwards
(the first check's "expandable" rows measured nothing of it). Here every case is a subprocess of
the same Python (``gpu_budget.py --case SPEC.json``) with the allocator set in its environment
before CUDA starts: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` or
``ADACC_CUDA_ALLOCATOR=default`` (torch's default: ``import adacc_hf`` would otherwise turn
expandable segments on).

`run_cases` runs a list of cases, a few at a time (each process has its own allocator, so cases
that only measure memory may share the device; cases that read the device's free memory or time
anything run alone), each under a timeout (its process group killed past it); a case that fails,
runs out of memory or times out is recorded, never raised. `bundle` packs files into tars within
the device tool's limits on what comes back from ``$OUT``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .env import Deadline

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_budget.py"
_ALLOCATOR_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ADACC_CUDA_ALLOCATOR")
_print_lock = threading.Lock()


def allocator_env(allocator: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a case under `allocator`: ``"default"`` (torch's), ``"expandable"``
    (expandable segments), or None (the library's default: ``import adacc_hf`` turns expandable
    segments on). Any allocator setting of `base` (default: this process's) is dropped first."""
    env = dict(os.environ if base is None else base)
    for var in _ALLOCATOR_VARS:
        env.pop(var, None)
    if allocator == "default":
        env["ADACC_CUDA_ALLOCATOR"] = "default"
    elif allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif allocator is not None:
        raise ValueError(f"allocator must be 'default', 'expandable' or None, not {allocator!r}")
    # the library's sources where it is not installed (the lent GPU machine); not the root, whose
    # kernels/ would shadow Hugging Face's `kernels` (the script puts the root last itself)
    paths = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT
    ]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *paths])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("ADACC_VERBOSITY", "info")  # plans and guard lines in the case's log
    return env


def run_case(spec: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """Run one case (``spec["name"]``, ``spec["allocator"]``, the rest for the case) in a fresh
    process; its result, with ``returncode``, ``wall_s``, its log's name and, where it failed,
    the log's tail."""
    name = spec["name"]
    spec = dict(spec, result=str(work / f"{name}.result.json"))
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = work / f"{name}.log"
    Path(spec["result"]).unlink(missing_ok=True)
    cmd = [sys.executable, str(SCRIPT), "--case", str(spec_path)]
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=allocator_env(spec.get("allocator")), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the case and what it started (a solver)
            rc = proc.wait()
    res: dict[str, Any] = {}
    if Path(spec["result"]).exists():
        res = json.loads(Path(spec["result"]).read_text())
    res.update(returncode=rc, wall_s=time.perf_counter() - t0, log=log_path.name)
    if timed_out:
        res["error"] = f"timed out after {timeout_s:.0f} s"
    elif "kind" not in res:
        res["error"] = f"exited {rc} without a result"
    if rc != 0 or "error" in res:
        res["log_tail"] = _tail(log_path, 30)
    return res


def run_cases(
    specs: Sequence[dict[str, Any]],
    work: Path,
    *,
    jobs: int,
    share: Deadline,
    overall: Deadline,
    timeout_s: float,
    report=None,
) -> dict[str, dict[str, Any]]:
    """Run `specs` (in order, `jobs` at a time); a case not started before `share` passes is
    skipped. Each waits at most `timeout_s`, and no longer than `overall`'s limit plus 20 s.
    `report(name, result)` prints a case's line as it ends. Returns results by case name."""
    work.mkdir(parents=True, exist_ok=True)

    def one(spec: dict[str, Any]) -> dict[str, Any]:
        if share.passed():
            return {"skipped": "time limit"}
        left = timeout_s
        if overall.limit is not None:
            left = min(left, max(20.0, overall.limit - overall.elapsed() + 20))
        res = run_case(spec, work, left)
        if report is not None:
            with _print_lock:
                report(spec["name"], res)
        return res

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [(s["name"], pool.submit(one, s)) for s in specs]
        return {name: f.result() for name, f in futures}


def _tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def bundle(
    files: Sequence[Path], out_dir: Path, stem: str, *, max_bytes: int, max_parts: int
) -> dict[str, Any]:
    """Pack `files` into ``<stem>-1.tar``, ``<stem>-2.tar``, ... in `out_dir`, each at most
    `max_bytes`, at most `max_parts` of them (the device tool returns a few files of a bounded
    size from ``$OUT``); written whole and renamed, so a run stopped meanwhile leaves the last
    complete set. Returns what went where and what did not fit."""
    parts: list[list[Path]] = []
    size = 0
    left_out = []
    for f in sorted(files):
        n = f.stat().st_size + 1024  # tar header and padding
        if n > max_bytes:
            left_out.append(f.name)
            continue
        if not parts or size + n > max_bytes:
            if len(parts) == max_parts:
                left_out.append(f.name)
                continue
            parts.append([])
            size = 0
        parts[-1].append(f)
        size += n
    written = {}
    for i, group in enumerate(parts, start=1):
        path = out_dir / f"{stem}-{i}.tar"
        tmp = path.with_suffix(".tar.tmp")
        with tarfile.open(tmp, "w") as tar:
            for f in group:
                tar.add(f, arcname=f.name)
        os.replace(tmp, path)
        written[path.name] = [f.name for f in group]
    return {"tars": written, "left_out": left_out}
