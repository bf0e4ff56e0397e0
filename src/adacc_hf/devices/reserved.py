"""What CUDA's caching allocator would reserve for a step, predicted on this CPU.

A step's allocations (recorded from ``torch.profiler``'s allocator events, `allocations`) are
replayed through the model of CUDA's caching allocator (`caching_allocator`) after the storages
the step starts with (parameters, buffers, gradients, optimizer states and the batch, allocated
first as a run allocates them before its first step). The result is the step's reserved peak on
the device: the bytes a budget has to hold there, where the step model predicts allocated ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..runtime.peak import resident_tensors, unique_storages
from .allocations import Event, record_allocations
from .caching_allocator import AllocatorPeaks, replay

__all__ = ["resident_events", "step_reserved"]


def resident_events(tensors: Iterable[Any]) -> list[Event]:
    """Allocations of the storages of `tensors`, each once, in order (ids ``-1, -2, ...``: apart
    from a recording's own)."""
    storages = unique_storages(tensors)
    return [("alloc", -1 - i, s.nbytes(), 0) for i, s in enumerate(storages)]


def step_reserved(
    model: nn.Module,
    step: Callable[[], object],
    optimizer: torch.optim.Optimizer | None = None,
    batch: Iterable[Any] = (),
    *,
    expandable: bool = True,
) -> AllocatorPeaks:
    """Run `step` once (a dry run's or a real one on this CPU) and replay what it allocated, after
    the storages it starts with, through the caching-allocator model.

    Args:
        model: the trained module (its parameters, buffers and gradients are resident).
        step: one training step (forward, backward, optimizer), run under the recorder.
        optimizer: its states are resident.
        batch: the batch's tensors (resident).
        expandable: model ``expandable_segments:True`` (what ``import adacc_hf`` sets) or the
            default allocator.

    Returns:
        The replay's peaks: ``reserved`` is the step's predicted reserved peak, the storages it
        started with included.
    """
    resident = resident_events(resident_tensors(model, optimizer, list(batch)))
    rec = record_allocations(step)
    return replay([*resident, *rec.events], expandable=expandable)
