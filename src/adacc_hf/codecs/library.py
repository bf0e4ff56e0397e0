"""Shared plumbing of the codecs whose format is a library's (:mod:`.bnb`, :mod:`.mx`,
:mod:`.fp8_rowwise`): lazy imports and the ``check(device)`` of their library backends.

The libraries are imported only when a library backend is checked or run, never by
``import adacc_hf``; a library that is missing, or fails to import, makes its backend
unavailable (:func:`.backends.unavailable` says why) and a pinned backend falls back to the
reference with one log line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import platform
from collections.abc import Callable, Sequence

import torch


@functools.cache
def import_problem(module: str) -> str | None:
    """None when ``module`` imports, else why not (cached: checked once per process)."""
    top = module.split(".")[0]
    try:
        if importlib.util.find_spec(top) is None:
            return f"{top} is not installed (pip install {top})"
        importlib.import_module(module)
    except Exception as err:  # any import failure makes the backend unavailable
        return f"{module} does not import ({type(err).__name__}: {err})"
    return None


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"0.50.2.dev0"`` -> (0, 50, 2)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.cache
def version_problem(distribution: str, minimum: str) -> str | None:
    """None when the installed ``distribution`` is at least ``minimum``, else why not."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} is not installed"
    if _release(found) < _release(minimum):
        return (
            f"{distribution} {found} is older than {minimum}, whose arithmetic the "
            "reference follows"
        )
    return None


def x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def library_check(
    modules: Sequence[str],
    minimum: str,
    devices: Sequence[str],
    why_not_device: str,
    extra: Callable[[torch.device], str | None] | None = None,
) -> Callable[[torch.device], str | None]:
    """A backend ``check(device)``: None where every one of ``modules`` imports, their
    distribution is at least version ``minimum``, the device's kind is one of ``devices`` and
    ``extra(device)`` (if given) has no objection."""

    def check(device: torch.device) -> str | None:
        device = torch.device(device)
        for module in modules:
            why = import_problem(module)
            if why is not None:
                return why
        why = version_problem(modules[0].split(".")[0], minimum)
        if why is not None:
            return why
        if device.type not in devices:
            return f"{why_not_device} (not on {device.type})"
        return extra(device) if extra is not None else None

    return check
