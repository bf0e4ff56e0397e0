"""Every Triton kernel the codecs launch compiles for real GPUs (ahead of time, on this CPU).

The interpreter tests (`test_kernels.py`) prove the kernels' arithmetic, but the interpreter
accepts code the compiler rejects: the first GPU run found every INT4 kernel failing to compile
(a module-level float read inside ``@triton.jit`` that only ``tl.constexpr(...)`` makes legal).
`kernel_compile.py` intercepts each launch and compiles it to a cubin for the target instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]


def _compile(*targets: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "kernel_compile.py"), *map(str, targets)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernels() -> set[str]:
    """Every launchable kernel defined in the package (device helpers are compiled inside them)."""
    import importlib
    import pkgutil

    import adacc_kernels

    names = set()
    for info in pkgutil.iter_modules(adacc_kernels.__path__):
        text = (Path(adacc_kernels.__path__[0]) / f"{info.name}.py").read_text()
        names |= {
            line.split("(")[0].removeprefix("def ")
            for line in text.splitlines()
            if line.startswith("def _") and line.split("(")[0].endswith("_kernel")
        }
    importlib.invalidate_caches()
    return names


def _check(res: dict, target: int) -> None:
    assert not res["failed"], "\n\n".join(f"{k}\n{v}" for k, v in res["failed"].items())
    compiled = {name.split("[")[0] for name in res["compiled"][str(target)]}
    assert _kernels() <= compiled, sorted(_kernels() - compiled)


def test_every_kernel_specialisation_compiles_for_hopper():
    _check(_compile(90), 90)


@pytest.mark.slow
def test_every_kernel_specialisation_compiles_for_ampere():
    _check(_compile(80), 80)
