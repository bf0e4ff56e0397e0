"""How the runtime calls a plain PyTorch model (`plain`) and its blocks.

`hook_forward` gives a plain block what transformers' `GradientCheckpointingLayer` has: an
instance-level ``forward`` that, when the block is training, gradients are on and
``block.gradient_checkpointing`` is set, runs the block's own forward through
``block._gradient_checkpointing_func`` (the runtime's `BlockRuntime`, or the tracer's hook). It
is installed while the runtime needs it (a policy applied, a trace) and removed after: the model
is left as it was. A plain model's batch is a mapping of its forward's arguments by name (plus
whatever its loss reads): `model_inputs` passes the forward the keys it takes (`plain_inputs`
where the caller has unwrapped the model and found its record already), `call_batch` rebuilds
such a mapping from a forward's own call.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .base import unwrap_model
from .generic import gradient_checkpointing_layer
from .plain import registered

__all__ = [
    "call_batch",
    "hook_forward",
    "model_inputs",
    "needs_hook",
    "plain_inputs",
    "unhook_forward",
]

_INNER = "_adacc_inner_forward"  # the forward the hook calls (an instance's own, or None)
_DEPTH = "_adacc_forward_hooks"  # how many users installed the hook


def _checkpointing_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A plain block's forward while hooked: `GradientCheckpointingLayer`'s rule."""
    inner = self.__dict__.get(_INNER) or functools.partial(type(self).forward, self)
    run = self.__dict__.get("_gradient_checkpointing_func")
    if (
        run is not None
        and self.__dict__.get("gradient_checkpointing")
        and self.training
        and torch.is_grad_enabled()
    ):
        return run(functools.partial(inner, **kwargs), *args)
    return inner(*args, **kwargs)


def needs_hook(block: nn.Module) -> bool:
    """Whether the runtime reaches `block` through `hook_forward` (not a transformers layer)."""
    gcl = gradient_checkpointing_layer()
    return gcl is None or not isinstance(block, gcl)


def hook_forward(block: nn.Module) -> None:
    """Route a plain block's forward through its checkpoint attributes (counted: every
    `hook_forward` takes one `unhook_forward`). Transformers layers are left as they are."""
    if not needs_hook(block):
        return
    d = block.__dict__
    if d.get(_DEPTH, 0) == 0:
        d[_INNER] = d.get("forward")
        d["forward"] = types.MethodType(_checkpointing_forward, block)
    d[_DEPTH] = d.get(_DEPTH, 0) + 1


def unhook_forward(block: nn.Module) -> None:
    """Undo one `hook_forward`; the last restores the block's forward as it was."""
    d = block.__dict__
    if _DEPTH not in d:
        return
    d[_DEPTH] -= 1
    if d[_DEPTH]:
        return
    del d[_DEPTH]
    inner = d.pop(_INNER, None)
    mine = getattr(d.get("forward"), "__func__", None) is _checkpointing_forward
    if mine and inner is None:
        del d["forward"]
    elif mine:
        d["forward"] = inner


# ------------------------------------------------------------------ batches
def model_inputs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `model`'s forward for `batch`: for a registered model the keys its
    forward takes (`plain_inputs`), else `batch` as it is."""
    base = unwrap_model(model)
    if registered(base) is None:
        return dict(batch)
    return plain_inputs(base, batch)


def plain_inputs(base: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a registered model's forward for `batch`: the keys it takes (all
    of them where it takes ``**kwargs``).

    Args:
        base: the registered model, unwrapped (`unwrap_model`).
        batch: a mapping of the forward's arguments by name (plus what the loss reads).

    Raises:
        UnsupportedModelError: `batch` lacks an argument the forward requires.
    """
    params = list(inspect.signature(base.forward).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(batch)
    named = [
        p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)
    ]
    names = {p.name for p in named}
    missing = [
        p.name for p in named if p.default is inspect.Parameter.empty and p.name not in batch
    ]
    if missing:
        raise UnsupportedModelError(
            f"the batch (keys {sorted(batch)}) has no {missing} for "
            f"{type(base).__name__}.forward: a batch is a mapping of the forward's "
            "arguments by name (plus what the loss reads)"
        )
    return {k: v for k, v in batch.items() if k in names}


def call_batch(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A training forward's arguments as a batch: a registered model's by its forward's parameter
    names; else the keywords, a first positional argument as ``input_ids``."""
    base = unwrap_model(model)
    if registered(base) is None:
        batch = dict(kwargs)
        if args:
            batch.setdefault("input_ids", args[0])
        return batch
    sig = inspect.signature(base.forward)
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError as e:
        raise UnsupportedModelError(f"{type(model).__name__}.forward{sig}: {e}") from e
    batch: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            batch.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise UnsupportedModelError(
                    f"{type(model).__name__}.forward takes *{name}: adacc-hf plans a batch of "
                    "named arguments; give the forward named parameters"
                )
        else:
            batch[name] = value
    return batch
