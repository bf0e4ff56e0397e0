"""A plain PyTorch model's blocks and loss (`adapters.plain`), checked on one forward before any
profiling: a block the forward never calls, calls twice, or calls without its hidden states as
a tensor first positional argument, and a loss that is not a scalar, are refused with a message
naming the module and what to change."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter, unwrap_model
from ..adapters.forward import plain_inputs
from ..adapters.plain import registered
from ..errors import UnsupportedModelError
from .context import devices_of, model_kwargs, train_mode
from .sharded import forwards_without_backward

__all__ = ["check_forward"]


def check_forward(model: nn.Module, batch: Mapping[str, Any]) -> None:
    """A plain model's blocks and loss, checked once on a forward of `batch` before any
    profiling (no gradients, train mode, no RNG side effects): every block runs once, with its
    hidden states as a tensor first positional argument, and the loss is a scalar. The blocks
    are put in the order the forward ran them. Raises `UnsupportedModelError` naming the module
    and what to change. A no-op for other models and once checked."""
    base = unwrap_model(model)
    spec = registered(base)
    if spec is None or spec.checked:
        return
    calls: list[str] = []
    bad: dict[str, str] = {}

    def seen(path: str) -> Callable:
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls.append(path)
            first = args[0] if args else None
            if not isinstance(first, torch.Tensor) or not first.is_floating_point():
                got = type(first).__name__ if args else f"keywords only ({', '.join(kwargs)})"
                bad.setdefault(path, got)

        return pre

    handles = [
        block.register_forward_pre_hook(seen(path), with_kwargs=True)
        for path, block in get_adapter(base).find_blocks(base)
    ]
    try:
        with (
            forwards_without_backward(base),
            train_mode(base),
            torch.random.fork_rng(devices=devices_of(base)),
            torch.no_grad(),
        ):
            out = base(**plain_inputs(base, model_kwargs(base, batch)))
            spec.loss_of(out, batch)
            del out
    finally:
        for h in handles:
            h.remove()
    missing = [p for p in spec.paths if p not in calls]
    if missing:
        raise UnsupportedModelError(
            f"blocks= names {missing} (of {len(spec.paths)}), which {type(base).__name__}'s "
            "forward never called on the batch given: name only blocks the forward runs"
        )
    again = sorted({p for p in calls if calls.count(p) > 1})
    if again:
        raise UnsupportedModelError(
            f"the forward called block(s) {again} more than once: a block is planned as run once "
            "per forward. Name blocks that run once (or give each use its own module)"
        )
    if bad:
        path, got = next(iter(bad.items()))
        raise UnsupportedModelError(
            f"block {path!r} ({type(base.get_submodule(path)).__name__}) was called with "
            f"{got} first: the runtime checkpoints a block whose first positional argument is "
            "its hidden states (a floating tensor). Call it as block(x, ...)"
        )
    spec.paths = sorted(spec.paths, key=calls.index)  # forward order
    spec.checked = True
