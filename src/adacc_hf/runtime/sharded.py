"""Forwards that have no backward (profiling, tracing, memory reports) on FSDP2-sharded models.

FSDP2 (`fully_shard`) keeps per-iteration state that a forward with no backward leaves behind:
parameters stay unsharded and the next step's update is wrong (measured: the root's parameters
drifted by 2e-2 after one SGD step). `forwards_without_backward` resets that state afterwards,
unless it runs inside a forward already under way (Adacc's first-forward hook), whose own
backward settles it. DeepSpeed ZeRO-3 needs nothing: it re-fetches parameters on every forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from torch import nn

_DEPTH = contextvars.ContextVar("adacc_sharded_depth", default=0)


def _fsdp_root(model: nn.Module) -> nn.Module | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def _in_forward(root: nn.Module) -> bool:
    state = root._get_fsdp_state()
    return getattr(getattr(state, "_state_ctx", None), "iter_forward_root", None) is not None


def _reset(root: nn.Module, model: nn.Module) -> None:
    reset = getattr(root, "reset_iter_state", None)  # torch >= 2.12
    if reset is not None:
        reset()
        return
    for m in model.modules():  # older torch: resharding every unit is what matters
        if hasattr(m, "reshard") and m.__class__.__name__.startswith("FSDP"):
            m.reshard()


@contextlib.contextmanager
def forwards_without_backward(model: nn.Module) -> Iterator[None]:
    """Leave an FSDP2 model between iterations as it was found. Nested uses do nothing."""
    root = _fsdp_root(model) if _DEPTH.get() == 0 else None
    outer = root is not None and not _in_forward(root)
    token = _DEPTH.set(_DEPTH.get() + 1)
    try:
        yield
    finally:
        _DEPTH.reset(token)
        if outer:
            _reset(root, model)
