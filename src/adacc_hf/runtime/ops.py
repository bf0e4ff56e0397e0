"""Naming the aten ops that run inside a block: regions (submodules) and per-region op keys.

Both the trace and the runtime name ops the same way, so a policy made from a trace addresses the
ops the runtime sees. Only ops that create new storage get a key: views, in-place ops and ops
without tensor outputs always run (they cost nothing to recompute, or cannot be cached).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

try:  # the helper torch's own selective checkpointing uses to cache outputs
    from torch.utils.checkpoint import _detach_helper as detach_for_cache
except ImportError:  # pragma: no cover - older torch

    def detach_for_cache(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else x


# detach: checkpointing runs extra ones in recompute; the others alias their input without saying
# so in their schema.
_IGNORED = {
    torch.ops.aten.detach.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.lift_fresh.default,
}


@functools.cache
def is_keyed(func: torch._ops.OpOverload) -> bool:
    """True when `func` creates new storage (not a view, not in-place, not ignored)."""
    if func in _IGNORED or func.is_view:
        return False
    schema = func._schema
    if schema.is_mutable:
        return False
    returns = schema.returns
    return bool(returns) and all(
        r.alias_info is None and isinstance(r.type, torch._C.TensorType) for r in returns
    )


def is_keyed_now(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> bool:
    """`is_keyed`, for ops that compute from activations. Under ``no_grad``, an op none of whose
    inputs requires grad gets no key and always runs: ZeRO-3's and FSDP's parameter all-gathers and
    prefetches run there and differ between the profiled block, the forward and the recompute (keys
    would shift). Ops inside a custom autograd Function's forward (ZeRO-3's linear) keep theirs."""
    if not is_keyed(func):
        return False
    if torch.is_grad_enabled():
        return True
    leaves = tree_flatten((args, kwargs))[0]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


@functools.cache
def is_mutable(func: torch._ops.OpOverload) -> bool:
    return func._schema.is_mutable


@functools.cache
def is_random(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def mutated_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place op writes to."""
    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(val, torch.Tensor):
                out.append(val)
    return out


def tensor_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class RegionTracker:
    """Knows which submodule of a block is running, via forward hooks on its submodules.

    The hooks push and pop the submodule's path (relative to the block); `current` is the innermost
    one, ``""`` for the block's own code. `remove()` takes every hook off again.
    """

    def __init__(self, block: nn.Module) -> None:
        self.stack: list[str] = []
        self._handles: list[Any] = []
        for name, mod in block.named_modules():
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._push(name)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))

    def _push(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def reset(self) -> None:
        self.stack.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class OpKeyer:
    """Gives each keyed op of one block run its key ``region/packet#k``."""

    def __init__(self, regions: RegionTracker) -> None:
        self.regions = regions
        self.counts: dict[tuple[str, str], int] = defaultdict(int)

    def key(self, func: torch._ops.OpOverload) -> tuple[str, str, str]:
        """(key, region, packet) for a keyed op."""
        region = self.regions.current
        packet = func.overloadpacket.__name__
        n = self.counts[(region, packet)]
        self.counts[(region, packet)] = n + 1
        return f"{region}/{packet}#{n}", region, packet
