"""Ground-truth activation memory, measured independently of any policy's bookkeeping.

`measure_activation_memory` runs one forward pass and records every storage created by an aten op
during it (outputs of non-view, non-in-place ops: the only way new activation storage appears),
with the block that was running. After the forward, the model outputs are dropped except the loss,
and the storages still alive are exactly what is held for backward: saved tensors, checkpoint
inputs, cached and encoded outputs. Parameters and buffers are never counted (they are not created
by forward), and each storage counts once.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..adapters import get_adapter, unwrap_model
from .ops import is_keyed, is_mutable, tensor_outputs
from .sharded import forwards_without_backward


@dataclass
class ActivationMemory:
    """Bytes held for backward after one forward: per block (by path) and outside the blocks."""

    total: int
    blocks: dict[str, int] = field(default_factory=dict)
    other: int = 0
    largest_other: int = 0  # the largest single storage outside the blocks

    @property
    def per_block_mean(self) -> float:
        return sum(self.blocks.values()) / max(1, len(self.blocks))


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: str = ""
        self.records: list[tuple[StorageWeakRef, int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_keyed(func):
            fresh = None
        elif is_mutable(func):
            return out
        else:  # composite ops seen whole (``to``, ``contiguous`` called inside another dispatch
            # mode, e.g. by a codec): count an output only if its storage is new
            fresh = {t.untyped_storage().data_ptr() for t in tensor_outputs((args, kwargs))}
        for t in tensor_outputs(out):
            s = t.untyped_storage()
            if s.nbytes() and (fresh is None or s.data_ptr() not in fresh):
                self.records.append((StorageWeakRef(s), s.data_ptr(), s.nbytes(), self.where))
        return out


def activation_memory_report(model: nn.Module, batch: Mapping[str, Any]) -> ActivationMemory:
    """Run `model(**batch)` and report what its autograd graph holds before backward."""
    base = unwrap_model(model)
    blocks = get_adapter(base).find_blocks(base)
    rec = _StorageRecorder()
    handles = []
    for path, block in blocks:

        def pre(mod, args, path=path):
            rec.where = path

        def post(mod, args, out):
            rec.where = ""

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post, always_call=True))
    try:
        with forwards_without_backward(base), rec:
            out = model(**batch)
        loss = out["loss"] if isinstance(out, Mapping) else out[0]
        del out
    finally:
        for h in handles:
            h.remove()
    gc.collect()
    seen: set[int] = set()
    report = ActivationMemory(total=0, blocks={p: 0 for p, _ in blocks})
    for ref, ptr, nbytes, where in rec.records:
        if ref.expired() or ptr in seen:
            continue
        seen.add(ptr)
        report.total += nbytes
        if where:
            report.blocks[where] += nbytes
        else:
            report.other += nbytes
            report.largest_other = max(report.largest_other, nbytes)
    del loss
    return report


def measure_activation_memory(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """Bytes held for backward between the end of forward and the start of backward."""
    return activation_memory_report(model, batch).total


def peak_step_memory(
    model: nn.Module, batch: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None
) -> int:
    """CUDA only: peak allocated bytes of one training step (forward, backward, optimizer step)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "peak_step_memory needs a CUDA device; on CPU use measure_activation_memory"
        )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = model(**batch)
    loss = out["loss"] if isinstance(out, Mapping) else out[0]
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()
