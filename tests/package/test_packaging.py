"""The wheel ships every subpackage, and the Triton kernels install as `adacc_kernels`."""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT / "src").parts)
        for p in (ROOT / "src" / "adacc_hf").rglob("__init__.py")
    }
    assert found | {"adacc_kernels"} == listed
    assert config["package-dir"]["adacc_kernels"] == "kernels"


def test_kernels_do_not_shadow_huggingface_kernels_package(tmp_path):
    """Installed, `import kernels` is not ours (run outside the checkout: `python -m` puts the
    current directory first on sys.path)."""
    import subprocess
    import sys

    code = (
        "import importlib.util, pathlib, adacc_kernels\n"
        f"root = pathlib.Path({str(ROOT)!r})\n"
        "assert pathlib.Path(adacc_kernels.__file__).parent == root / 'kernels'\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is None or pathlib.Path(spec.origin).parent != root / 'kernels', spec\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
