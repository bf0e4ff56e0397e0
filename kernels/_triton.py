"""Is Triton usable here? Answered lazily: importing this module never imports triton.

Triton decides at *kernel definition* time (``@triton.jit``) whether kernels run compiled (GPU)
or in its CPU interpreter (``TRITON_INTERPRET=1``). The kernel modules of this package are only
imported on first use (by :mod:`adacc_kernels.ops`), so the variable must be set before that first use,
not necessarily before ``import adacc_kernels``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

__all__ = [
    "KernelUnavailableError",
    "check_launchable",
    "interpreter_requested",
    "triton_available",
    "triton_version",
]


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was requested where it cannot run; the message says what to change."""


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works (checked once, on first call)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton.language")
    except Exception:  # a broken install must not break the torch fallback
        return False
    return True


def triton_version() -> str | None:
    if not triton_available():
        return None
    import triton

    return triton.__version__


def interpreter_requested() -> bool:
    """``TRITON_INTERPRET=1`` in the environment (Triton's own switch for its CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(device: torch.device) -> None:
    """Raise :class:`KernelUnavailableError` unless Triton kernels can run on ``device``."""
    if not triton_available():
        raise KernelUnavailableError(
            "Triton kernels requested but triton is not importable; install it "
            "(`pip install 'adacc-hf[triton]'`) or use ADACC_KERNELS=torch"
        )
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise KernelUnavailableError(f"Triton kernels support CUDA tensors only, got {device}")
    if not interpreter_requested():
        raise KernelUnavailableError(
            "Triton kernels on CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 "
            "before the first kernel use (or use ADACC_KERNELS=torch / auto on CPU)"
        )
    from . import _common  # defines the shared kernels (imports triton)

    if not _common.INTERPRETED:
        raise KernelUnavailableError(
            "the kernels were defined without TRITON_INTERPRET=1 (adacc_kernels.* was imported before "
            "the variable was set); set it before the first kernel use, in a fresh process"
        )
