"""Ground-truth activation memory, measured independently of any policy's bookkeeping.

`measure_activation_memory` runs one forward pass and records every storage created by an aten op
during it (outputs of non-view, non-in-place ops: the only way new activation storage appears),
with the block that was running. After the forward, the model outputs are dropped except the loss,
and the storages still alive are exactly what is held for backward: saved tensors, checkpoint
inputs, cached and encoded outputs. Parameters and buffers are never counted (they are not created
by forward), and each storage counts once.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..adapters import get_adapter, unwrap_model
from .ops import is_keyed, is_mutable, param_cast, tensor_outputs
from .peak import forward_loss
from .sharded import forwards_without_backward


@dataclass
class ActivationMemory:
    """Bytes held for backward after one forward: per block (by path) and outside the blocks.

    What `activation_memory_report` returns.

    Attributes:
        total: every byte held for backward.
        blocks: bytes per block, by path.
        other: bytes outside the blocks (``before`` + ``after``).
        largest_other: the largest single storage outside the blocks.
        before: outside the blocks, created before the first block ran: embeddings, masks.
        after: outside the blocks, created after: final norm, logits, loss.
        casts: of each block's bytes, autocast's casts of parameters (the weight-cast cache
            holds them for the whole autocast region anyway: they cost a block extra only once
            that region has ended).
    """

    total: int
    blocks: dict[str, int] = field(default_factory=dict)
    other: int = 0
    largest_other: int = 0  # the largest single storage outside the blocks
    before: int = 0
    after: int = 0
    # Of each block's bytes, autocast's casts of parameters (the weight-cast cache holds them for
    # the whole autocast region anyway: they cost a block extra only once that region has ended).
    casts: dict[str, int] = field(default_factory=dict)

    @property
    def per_block_mean(self) -> float:
        return sum(self.blocks.values()) / max(1, len(self.blocks))


@contextlib.contextmanager
def young_objects() -> Iterator[None]:
    """Inside, a `gc.collect` scans only the objects created since entry (the others frozen,
    `gc.freeze`): counting the storages still alive needs a collection to drop cycles, and a full
    one took 0.35-0.4 s in a process holding SmolLM2, longer than a tiny batch's block runs. Where
    something else froze objects already, collections stay full."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class StorageRecorder(TorchDispatchMode):
    """Records every storage an aten op creates (not views, not in-place), with ``where`` (set by
    the caller: the block running) at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.where: str = ""
        self.blocks_started = False
        self.records: list[tuple[StorageWeakRef, int, int, str, bool, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_keyed(func):
            fresh = None
        elif is_mutable(func):
            return out
        else:  # composite ops seen whole (``to``, ``contiguous`` called inside another dispatch
            # mode, e.g. by a codec): count an output only if its storage is new
            fresh = {t.untyped_storage().data_ptr() for t in tensor_outputs((args, kwargs))}
        cast = param_cast(func, args)
        for t in tensor_outputs(out):
            s = t.untyped_storage()
            if s.nbytes() and (fresh is None or s.data_ptr() not in fresh):
                where, started = self.where, self.blocks_started
                self.records.append(
                    (StorageWeakRef(s), s.data_ptr(), s.nbytes(), where, started, cast)
                )
        return out

    def alive(self) -> Iterator[tuple[int, str, bool, bool]]:
        """``(nbytes, where, after blocks started, is a parameter cast)`` of each recorded storage
        still alive, each once."""
        gc.collect()
        seen: set[int] = set()
        for ref, ptr, nbytes, where, after, cast in self.records:
            if ref.expired() or ptr in seen:
                continue
            seen.add(ptr)
            yield nbytes, where, after, cast


@contextlib.contextmanager
def recorded_forward(
    model: nn.Module,
    batch: Mapping[str, Any],
    block_hooks: Any = None,
    autocast: Any = None,
) -> Iterator[tuple[Callable[[], ActivationMemory], torch.Tensor]]:
    """Run `model(**batch)` recording every storage its ops create; yields ``(report, loss)``
    where ``report()`` counts what is alive right now. `block_hooks(path, block)` may return more
    hook handles to install on each block (removed with these); `autocast` is a context manager
    entered around the forward only."""
    with young_objects(), _recorded_forward(model, batch, block_hooks, autocast) as out:
        yield out


@contextlib.contextmanager
def _recorded_forward(
    model: nn.Module, batch: Mapping[str, Any], block_hooks: Any, autocast: Any
) -> Iterator[tuple[Callable[[], ActivationMemory], torch.Tensor]]:
    base = unwrap_model(model)
    blocks = get_adapter(base).find_blocks(base)
    rec = StorageRecorder()
    handles = []
    for path, block in blocks:

        def pre(mod, args, path=path):
            rec.where = path
            rec.blocks_started = True

        def post(mod, args, out):
            rec.where = ""

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post, always_call=True))
        if block_hooks is not None:
            handles += list(block_hooks(path, block))
    try:
        with forwards_without_backward(base), rec, autocast or contextlib.nullcontext():
            loss = forward_loss(model, batch)  # a plain model's loss= too: its storages count
    except BaseException:
        for h in handles:
            h.remove()
        raise

    def report() -> ActivationMemory:
        paths = [p for p, _ in blocks]
        result = ActivationMemory(
            total=0, blocks=dict.fromkeys(paths, 0), casts=dict.fromkeys(paths, 0)
        )
        for nbytes, where, after, cast in rec.alive():
            result.total += nbytes
            if where:
                result.blocks[where] += nbytes
                result.casts[where] += nbytes if cast else 0
            else:
                result.other += nbytes
                result.largest_other = max(result.largest_other, nbytes)
                if after:
                    result.after += nbytes
                else:
                    result.before += nbytes
        return result

    try:
        yield report, loss
    finally:
        for h in handles:
            h.remove()


def activation_memory_report(
    model: nn.Module, batch: Mapping[str, Any], autocast: Any = None
) -> ActivationMemory:
    """Run `model(**batch)` and report what its autograd graph holds before backward.

    Every storage an op creates during the forward is recorded with the block running it; the
    outputs are dropped except the loss, and what is still alive is held for backward. No
    backward runs.

    Args:
        model: the model (or a wrapper of it), patched or not.
        batch: a micro-batch whose forward returns the loss (``out.loss`` / ``out[0]``; a plain
            model's: what its forward and ``loss`` take).
        autocast: a context manager entered around the forward only (e.g.
            ``torch.autocast("cuda", dtype=torch.bfloat16)``); None: none.

    Returns:
        The `ActivationMemory`: in all, per block and outside the blocks.
    """
    with recorded_forward(model, batch, autocast=autocast) as (report, _loss):
        return report()


def measure_activation_memory(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """Bytes held for backward between the end of forward and the start of backward.

    Args:
        model: the model (or a wrapper of it), patched or not.
        batch: a micro-batch whose forward returns the loss.

    Returns:
        ``activation_memory_report(model, batch).total``.
    """
    return activation_memory_report(model, batch).total
