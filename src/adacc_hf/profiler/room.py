"""How many bytes profiling may add under a budget: the budget less what is alive when it starts.

Profiling runs inside the run's first training forward of each bucket, so its runs share the
device with the run's live state. On CUDA that state is read (the caching allocator's allocated
bytes, a host counter). Elsewhere it is counted: parameters, buffers, gradients present now and
`tensors` (the batch and its padded copy), plus `states_nbytes`, the optimizer's states and master
weights, counted whether they exist yet or not (before the first optimizer step they do not; a
resumed run loads them first), so the room is never over-stated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..runtime.peak import live_state_nbytes

__all__ = ["profiling_room"]


def profiling_room(
    model: nn.Module, budget: int, tensors: Iterable[Any] = (), states_nbytes: int = 0
) -> int:
    """The bytes profiling may add above what is alive now without passing `budget` (>= 0)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        live = torch.cuda.memory_allocated(device)
    else:
        live = live_state_nbytes(model, tensors=list(tensors)) + states_nbytes
    return max(0, budget - live)
