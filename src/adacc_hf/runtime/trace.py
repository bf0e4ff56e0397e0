"""Trace one block of each block group: the ordered list of ops that `Policy` tables address."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..adapters import Adapter, BlockGroup, get_adapter, unwrap_model
from ..adapters.forward import hook_forward, model_inputs, unhook_forward
from ..codecs.bitpack import mask_scale
from ..schema import BlockTrace, ModelTrace, OpSpec
from .context import autocast_context, devices_of, model_kwargs, train_mode
from .kept import side_nbytes
from .ops import (
    IGNORED,
    KEYED,
    MUTABLE,
    NATIVE_DROPOUT,
    OpKeyer,
    RegionTracker,
    draws_random,
    key_kind,
    mutated_args,
    rng_before,
    rng_moved,
    shape_class,
    storage_id,
    tensor_outputs,
)
from .plain import check_forward
from .sharded import forwards_without_backward


@dataclass
class _Rec:
    key: str
    region: str
    packet: str
    aten: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    random: bool
    ranks: str = ""
    native_mask: bool = False  # native_dropout: (output, bool mask)
    side: int = 0  # what a compressed entry keeps besides the first output's payload
    read: bool = False  # some op other than an in-place one has used the output
    fills: int = 0  # in-place ops on the output before it was read
    random_fill: bool = False  # one of them drew from an RNG (CPU dropout's noise)
    fill_is_mask: bool = False  # the filled value is a 0-or-scale mask (bitpack-exact)
    mutated: bool = False  # written in place after being read (or filled without an RNG)
    saved: bool = False
    elapsed: Any = None
    inputs: set[int] = field(default_factory=set)  # the records whose outputs it reads

    @property
    def mask(self) -> bool:
        return self.native_mask or (self.random_fill and self.fill_is_mask and not self.mutated)

    @property
    def cacheable(self) -> bool:
        return not self.mutated and (self.fills == 0 or self.random_fill)


def _extend(elapsed: Any, more: Any) -> Any:
    """One timing covering an op and the in-place fills that complete its output (CPU: the sum;
    CUDA events: from the op's start to the last fill's end)."""
    if elapsed is None or more is None:
        return elapsed
    if isinstance(elapsed, tuple):
        return (elapsed[0], more[1])
    return elapsed + more


class _Recorder(TorchDispatchMode):
    """Records every keyed op of one block run (and, with a timer, how long each op took).

    An op whose output is filled in place before anything reads it (``empty_like`` then
    ``bernoulli_`` and ``div_``: CPU dropout's noise) is recorded with its fills: their time is
    its time, and a random fill makes it a cacheable mask op (the runtime replays the RNG)."""

    def __init__(self, keyer: OpKeyer, timer: Any = None) -> None:
        super().__init__()
        self.keyer = keyer
        self.timer = timer
        self.outputs: list[Any] = []  # filled when a timer keeps outputs
        self.other_ms: list[Any] = []  # timings of ops that always rerun (views, in-place)
        self.recs: list[_Rec] = []
        self.produced: dict[int, int] = {}  # storage -> index into recs
        # storage an unkeyed op made (a cast, a no-grad op) -> the records it was made from
        self.derived: dict[int, set[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = key_kind(func, args, kwargs)
        rng = rng_before(func, args, kwargs) if kind in (KEYED, MUTABLE) else None
        if self.timer is None:
            out = func(*args, **kwargs)
            elapsed = None
        else:
            out, elapsed = self.timer(func, args, kwargs)
        random = rng is not None and (draws_random(func, args, kwargs) or rng_moved(rng))
        sources = self._sources(args, kwargs) if reads_values(func) else set()
        if kind == MUTABLE:
            filled = None
            for t in mutated_args(func, args, kwargs):
                idx = self.produced.get(storage_id(t))
                if idx is None:
                    continue
                rec = self.recs[idx]
                rec.inputs |= sources - {idx}
                if rec.read:
                    rec.mutated = True
                else:
                    rec.fills += 1
                    rec.random_fill |= random
                    filled = rec
            if filled is not None and self.timer is not None:
                filled.elapsed = _extend(filled.elapsed, elapsed)
            elif elapsed is not None:
                self.other_ms.append(elapsed)
            return out
        if func not in IGNORED:
            self._note_reads(args, kwargs)
        if kind != KEYED:
            for t in tensor_outputs(out) if sources else ():
                sid = storage_id(t)
                if sid not in self.produced:
                    self.derived[sid] = sources
            if elapsed is not None:
                self.other_ms.append(elapsed)
            return out
        tensors = tensor_outputs(out)
        key, region, packet = self.keyer.key(func)
        first = tensors[0]
        rec = _Rec(
            key=key,
            region=region,
            packet=packet,
            aten=str(func),
            shape=tuple(first.shape),
            dtype=str(first.dtype),
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
            random=random,
            ranks=shape_class(tensors),
            native_mask=func is NATIVE_DROPOUT,
            side=side_nbytes(out),
            inputs=sources,
        )
        for t in tensors:
            if t.numel():
                self.produced[storage_id(t)] = len(self.recs)
        self.recs.append(rec)
        if self.timer is not None:
            rec.elapsed = elapsed
            self.outputs.append(out)
        return out

    def _sources(self, args: tuple, kwargs: dict) -> set[int]:
        """The records whose outputs these inputs are, or were made from (views: one storage)."""
        out: set[int] = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                sid = storage_id(t)
                idx = self.produced.get(sid)
                if idx is not None:
                    out.add(idx)
                else:
                    out |= self.derived.get(sid, set())
        return out

    def feeding_backward(self, saved: set[int]) -> list[bool]:
        """Per record: whether backward reads its output (`saved` storages), or reads what is
        made from it. A compiled graph neither saves nor recomputes an op that does not: the
        partitioner recomputes only what backward reads (llama: the MLP's down projection)."""
        need = [r.saved for r in self.recs]
        for sid in saved:
            for i in self.derived.get(sid, ()):
                need[i] = True
        changed = True
        while changed:  # an in-place op can make an earlier record read a later one
            changed = False
            for j in reversed(range(len(self.recs))):
                if need[j]:
                    for i in self.recs[j].inputs - {j}:
                        if not need[i]:
                            need[i] = changed = True
        return need

    def _note_reads(self, args: tuple, kwargs: dict) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            idx = self.produced.get(storage_id(t))
            if idx is None or self.recs[idx].read:
                continue
            rec = self.recs[idx]
            rec.read = True
            if rec.random_fill:
                rec.fill_is_mask = t.dtype == torch.bool or not bool(torch.isnan(mask_scale(t)))
            elif rec.fills:
                rec.mutated = True  # filled without an RNG: not a mask, not cached


@functools.cache
def reads_values(func: Any) -> bool:
    """False for factories that read only their input's shape (``empty_like``, ``new_zeros``):
    CPU dropout's noise is made by ``empty_like`` of the dropped tensor, which backward never
    needs."""
    name = func._schema.name.split("::")[-1]
    return not (name.endswith("_like") or name.startswith("new_"))


class _TraceDone(Exception):
    pass


def dummy_batch(model: nn.Module, batch_size: int = 1, seq_len: int = 16) -> dict[str, Any]:
    """A small deterministic batch that runs `model` (for tracing without user data)."""
    config = model.config
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(config, "vocab_size", 100))
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g).to(device)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        batch["labels"] = ids[:, : max(1, seq_len // 2)].clone()
    else:
        batch["labels"] = ids.clone()
    return batch


def run_representatives(
    model: nn.Module,
    batch: Mapping[str, Any] | None,
    visit: Callable[[Adapter, BlockGroup, nn.Module, Callable, tuple], Any],
) -> None:
    """Run the model forward in train mode (no RNG side effects) and hand the first block of each
    group to `visit(adapter, group, block, fn, args)`, which must return `fn(*args)`'s result.

    Blocks are reached through transformers' per-layer checkpoint hook (a plain model's through
    `adapters.plain.hook_forward`), so they see exactly the arguments a checkpointed block sees in
    training. The forward stops after the last visit. A plain model's blocks are checked first
    (`check_forward`).
    """
    adapter = get_adapter(model)
    base = unwrap_model(model)
    groups = adapter.block_groups(base)
    if not groups:
        raise ValueError(f"found no transformer blocks in {type(base).__name__}")
    if batch is None:
        batch = dummy_batch(base)
    check_forward(base, batch)
    pending = {id(g.modules[0]) for g in groups}
    saved_attrs = []

    def hook(group: BlockGroup, block: nn.Module):
        def run(fn, *args):
            out = visit(adapter, group, block, fn, args)
            pending.discard(id(block))
            if not pending:
                raise _TraceDone
            return out

        return run

    for g in groups:
        block = g.modules[0]
        saved_attrs.append((block, dict(block.__dict__)))
        hook_forward(block)
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = hook(g, block)
    try:
        with (
            forwards_without_backward(base),
            train_mode(base),
            torch.random.fork_rng(devices=devices_of(base)),
            contextlib.suppress(_TraceDone),
        ):
            base(**model_inputs(base, model_kwargs(base, batch)))
    finally:
        for block, attrs in saved_attrs:
            for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                if name in attrs:
                    setattr(block, name, attrs[name])
                else:
                    block.__dict__.pop(name, None)
            unhook_forward(block)
    if pending:
        missing = [g.name for g in groups if id(g.modules[0]) in pending]
        raise RuntimeError(f"the forward pass never ran block group(s) {missing}")


def record_block(
    adapter: Adapter,
    group: BlockGroup,
    block: nn.Module,
    fn: Callable,
    args: tuple,
    timer: Any = None,
) -> tuple[Any, _Recorder, list[OpSpec]]:
    """Run one block once under the recorder; returns (output, recorder, op specs)."""
    regions = RegionTracker(block)
    rec = _Recorder(OpKeyer(regions), timer)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(storage_id(t))
        # a detached alias, never `t` itself: a node saving its own output through a hook that
        # returns the same tensor object makes a cycle through C++ (tensor -> grad_fn -> saved
        # variable -> tensor) that no collector frees; the traced forward is aborted before any
        # backward, so every block traced leaked its activations (a bucket's worth on a GPU)
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
            out = fn(*args)
    finally:
        regions.remove()
    for sid, idx in rec.produced.items():
        if sid in saved:
            rec.recs[idx].saved = True
    feeds = rec.feeding_backward(saved)
    types = adapter.layer_types([(r.region, r.packet) for r in rec.recs], group)
    ops = [
        OpSpec(
            key=r.key,
            layer_type=t,
            shape=r.shape,
            dtype=r.dtype,
            nbytes=r.nbytes,
            saved=r.saved,
            cacheable=r.cacheable,
            aten=r.aten,
            shape_class=r.ranks,
            mask=r.mask,
            side_nbytes=0 if r.mask else r.side,  # a mask is kept alone (bit-packed)
            rng_states=int(r.random) + (r.fills if r.mask and not r.random else 0),
            feeds_backward=f,
        )
        for r, t, f in zip(rec.recs, types, feeds, strict=True)
    ]
    return out, rec, ops


def first_tensor_nbytes(args: tuple) -> int:
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return first.numel() * first.element_size() if first is not None else 0


def trace_model(
    model: nn.Module,
    batch: Mapping[str, Any] | None = None,
    autocast: torch.dtype | None = None,
) -> ModelTrace:
    """Trace one block per group: the ordered op list that `Policy` tables address.

    Pass the real micro-batch for shapes that match training, and the run's `autocast` dtype
    (mixed precision) for its ops and dtypes.

    Args:
        model: the model to trace.
        batch: a micro-batch to trace on (default: `dummy_batch`).
        autocast: the dtype the run's forward autocasts to.

    Returns:
        The `ModelTrace`: per block group, one block's ops (`OpSpec`) in order, with its path,
        number of blocks and input bytes.

    Raises:
        UnsupportedModelError: the model has no adapter (the message says what to change).
    """
    traces: dict[str, BlockTrace] = {}

    def visit(adapter, group, block, fn, args):
        out, _, ops = record_block(adapter, group, block, fn, args)
        traces[group.name] = BlockTrace(
            group=group.name,
            path=group.paths[0],
            num_blocks=len(group.modules),
            input_nbytes=first_tensor_nbytes(args),
            ops=ops,
        )
        return out

    device = next(model.parameters()).device
    with autocast_context(device, autocast, cache=False):
        run_representatives(model, batch, visit)
    adapter = get_adapter(model)
    return ModelTrace(adapter.model_type(model), adapter.name, adapter.version, traces)
