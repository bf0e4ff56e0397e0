"""Running a model or block the way a training step does: its autocast region (and leaving a
caller's), training mode, the inputs a block gets when it runs alone, the devices it is on."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def model_kwargs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = dict(batch)
    if getattr(getattr(model, "config", None), "use_cache", False) or "use_cache" in kwargs:
        kwargs["use_cache"] = False  # as the Trainer trains: no KV cache copies
    return kwargs


def devices_of(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def autocast_context(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """``torch.autocast`` to `dtype` on `device`'s type (a no-op context for None), with an empty
    weight-cast cache on entry and exit.

    ``cache=False`` when one context runs a block several times (profiling): with the cast cache a
    weight is cast only the first time, while every real step (and every recompute) casts it.
    Inside a caller's own autocast region (a custom loop that calls `prepare` under
    ``torch.autocast``) torch clears the cache only when the outermost region exits: without the
    clearing here, casts cached by one measured forward would be missing from the next one's
    bytes."""
    if dtype is None:
        yield
        return
    torch.clear_autocast_cache()
    try:
        with torch.autocast(device.type, dtype=dtype, cache_enabled=cache):
            yield
    finally:
        torch.clear_autocast_cache()


@contextlib.contextmanager
def outside_autocast(device: torch.device):
    """Run the body as if no autocast region were open on `device`'s type: a caller's region
    (a custom loop calling the model under ``torch.autocast``, where a session plans in the
    forward pre-hook) is suspended, its nesting level included, and restored after. Inside it
    torch clears the weight-cast cache only when the outermost region exits, so a profiled
    backward's recomputes kept every block's casts (T5 under bf16: 262,144 bytes over the step,
    whose backward runs outside the region and frees each block's casts after its recompute)."""
    kind = device.type
    enabled = torch.is_autocast_enabled(kind)
    levels = 0
    while torch.autocast_decrement_nesting() >= 0:
        levels += 1
    torch.autocast_increment_nesting()  # back from -1 to 0
    if not levels and not enabled:
        yield
        return
    dtype = torch.get_autocast_dtype(kind)
    torch.clear_autocast_cache()
    torch.set_autocast_enabled(kind, False)
    try:
        yield
    finally:
        torch.clear_autocast_cache()
        torch.set_autocast_enabled(kind, enabled)
        torch.set_autocast_dtype(kind, dtype)
        for _ in range(levels):
            torch.autocast_increment_nesting()


def detached_input(x0: Any) -> tuple[Any, Any]:
    """(leaf, what the block gets) for running a block alone on its recorded input `x0`: the
    gradient is taken with respect to the leaf; the block gets a view of it, as a block's real
    input is never a leaf. A leaf that requires grad looks like a parameter to autocast's
    weight-cast cache and to the op keys (`ops.param_cast`): its cast would get no key (seen as
    BERT's Q/K/V regions, which cast the block input, not matching their policy)."""
    if not isinstance(x0, torch.Tensor):
        return x0, x0
    x = x0.detach().requires_grad_(x0.requires_grad)
    return x, (x.view_as(x) if x.requires_grad else x)


@contextlib.contextmanager
def train_mode(model: nn.Module):
    """Put `model` in training mode for the block, then restore every module's flag."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t
