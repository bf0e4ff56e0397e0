"""Naming the aten ops that run inside a block: regions (submodules), op keys and signatures.

Both the trace and the runtime name ops the same way (`key_kind` is the one rule), so a policy
made from a trace addresses the ops the runtime sees. Only ops that create new storage get a key:
views, in-place ops and ops without tensor outputs always run (they cost nothing to recompute, or
cannot be cached). Ops that return integers beside their tensors (CUDA flash / cuDNN attention)
get keys too, and so do random ops (dropout, attention with dropout): the runtime replays their
RNG state. An op is random when torch tags it so or when its generator moves across it
(`rng_moved`: custom ops such as flash-attn's carry no tag).

An op's *signature* is (op overload, output dtype, shape class); the shape class is the rank of
each tensor output (``"4,3"`` for attention's output and log-sum-exp), which a change of batch
size or sequence length leaves alone.
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


#: Aliases that neither make storage nor read it: never keyed, never a tensor's first use. detach:
#: checkpointing runs extra ones in recompute, and one was seen between a fresh tensor and a custom
#: op filling it in place; the others alias their input without saying so in their schema.
IGNORED = frozenset(
    {
        torch.ops.aten.detach.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.lift_fresh.default,
    }
)
_SCALAR_RETURNS = frozenset({"IntType", "SymIntType", "FloatType", "BoolType"})
#: The op kinds of the dispatch hot path (`op_kind`).
PLAIN, KEYED, MUTABLE = 0, 1, 2
NATIVE_DROPOUT = torch.ops.aten.native_dropout.default


@functools.cache
def is_keyed(func: torch._ops.OpOverload) -> bool:
    """True when `func` creates new storage: not a view, not in-place, not ignored, at least one
    tensor output and otherwise only tensors or plain scalars (ints of flash attention)."""
    if func in IGNORED or func.is_view:
        return False
    schema = func._schema
    if schema.is_mutable:
        return False
    returns = schema.returns
    if not returns or any(r.alias_info is not None for r in returns):
        return False
    tensors = [isinstance(r.type, torch._C.TensorType) for r in returns]
    scalars = [r.type.kind() in _SCALAR_RETURNS for r in returns]
    return any(tensors) and all(t or s for t, s in zip(tensors, scalars, strict=True))


_KINDS: dict[Any, int] = {}


def op_kind(func: torch._ops.OpOverload) -> int:
    """PLAIN, KEYED or MUTABLE (one dict lookup once known: the dispatch hot path asks per op)."""
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = MUTABLE if is_mutable(func) else KEYED if is_keyed(func) else PLAIN
    return kind


def keyed_now(args: tuple, kwargs: dict | None) -> bool:
    """Under ``no_grad``, does an op with these inputs get a key? Only if one of its inputs
    requires grad: ZeRO-3's and FSDP's parameter all-gathers and prefetches run under
    ``no_grad`` and differ between the profiled block, the forward and the recompute (keys would
    shift). Ops inside a custom autograd Function's forward (ZeRO-3's linear) keep theirs."""
    leaves = tree_flatten((args, kwargs))[0]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


_TO_COPY = torch.ops.aten._to_copy.default


def param_cast(func: torch._ops.OpOverload, args: tuple) -> bool:
    """A cast of a parameter (a leaf that requires grad): exactly what autocast's weight-cast cache
    holds, so whether it runs depends on the cache (the first use in an autocast region casts,
    later ones hit the cache; the profile, the forward and the recompute differ). It gets no key
    and always runs, so keys never shift with the cache."""
    if func is not _TO_COPY or not args:
        return False
    t = args[0]
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


_grad_enabled = torch.is_grad_enabled


def key_kind(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> int:
    """The one rule that decides which op calls get a key; the trace, the forward and the
    recompute all ask it, so their keys never drift apart. MUTABLE for an in-place op; KEYED when
    this call takes the block's next key: a keyed op (`is_keyed`) with grad enabled or an input
    that requires grad (`keyed_now`), unless it casts a parameter (`param_cast`); else PLAIN.
    The dispatch hot path asks it per op: one dict lookup and no allocation for most ops."""
    kind = _KINDS.get(func)
    if kind is None:
        kind = op_kind(func)
    if kind != KEYED:
        return kind
    if not (_grad_enabled() or keyed_now(args, kwargs)):
        return PLAIN
    if func is _TO_COPY and param_cast(func, args):
        return PLAIN
    return KEYED


@functools.cache
def is_mutable(func: torch._ops.OpOverload) -> bool:
    return func._schema.is_mutable


@functools.cache
def is_random(func: torch._ops.OpOverload) -> bool:
    """Tagged random (``nondeterministic_seeded``); ops without the tag: `rng_moved`."""
    return torch.Tag.nondeterministic_seeded in func.tags


@functools.cache
def _dropout_arg(func: torch._ops.OpOverload) -> tuple[int, Any] | None:
    """(position, default) of `func`'s ``dropout_p`` argument; None without one."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            return i, a.default_value
    return None


def draws_random(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> bool:
    """Whether this call draws from an RNG by torch's tag: a tagged attention op called with
    ``dropout_p=0`` (a model without attention dropout, or evaluating) does not, and its outputs
    are kept as any other's (no generator state beside them; compiled, a ``MUST_SAVE`` tag). Ops
    without the tag: `rng_moved`."""
    if not is_random(func):
        return False
    arg = _dropout_arg(func)
    if arg is None:
        return True
    i, default = arg
    p = args[i] if i < len(args) else (kwargs or {}).get("dropout_p", default)
    return bool(p != 0)


def mutated_args(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict | None
) -> list[torch.Tensor]:
    """The tensors an in-place op writes to."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else (kwargs or {}).get(a.name)
            if isinstance(val, torch.Tensor):
                out.append(val)
    return out


def tensor_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def shape_class(tensors: list[torch.Tensor]) -> str:
    """The rank of each tensor output, e.g. ``"4,3"``: the part of the shapes that a change of
    batch size or sequence length leaves alone."""
    return ",".join(str(t.dim()) for t in tensors)


def mask_of(out: Any) -> torch.Tensor | None:
    """The keep-mask a mask op yields: its bool output (``native_dropout``), or the op's one
    tensor output (a tensor filled in place by an RNG op, CPU dropout's float noise)."""
    tensors = tensor_outputs(out)
    for t in reversed(tensors):
        if t.dtype == torch.bool:
            return t
    return tensors[0] if len(tensors) == 1 else None


def cache_target(mask: bool, out: Any) -> torch.Tensor:
    """The tensor a codec compresses for an op: its mask for a mask op, else its first output
    (the profiler and the runtime agree through this)."""
    if mask:
        m = mask_of(out)
        if m is not None:
            return m
    return tensor_outputs(out)[0]


# -- RNG state ------------------------------------------------------------------------------


@functools.cache
def _generator_arg(func: torch._ops.OpOverload) -> int | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            return i
    return None


def generator_of(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None, device: Any):
    """The generator a random op draws from: its ``generator`` argument, else the default
    generator of ``device`` (None where torch has none to offer)."""
    i = _generator_arg(func)
    if i is not None:
        g = args[i] if i < len(args) else (kwargs or {}).get("generator")
        if isinstance(g, torch.Generator):
            return g
    device = torch.device(device)
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if not gens:
        return None
    index = device.index if device.index is not None else module.current_device()
    return gens[index]


def device_of(args: tuple, out: Any) -> torch.device:
    for t in tensor_outputs(out) or tensor_outputs(args):
        return t.device
    return torch.device("cpu")


def rng_mark(gen: torch.Generator | None) -> Any:
    """Where `gen` stands, read on the host without waiting for the device: a philox
    generator's (seed, offset) (CUDA), else its state's bytes (CPU: ~2 us)."""
    if gen is None:
        return None
    if gen.device.type != "cpu":
        try:
            return gen.initial_seed(), gen.get_offset()
        except RuntimeError:  # a generator without an offset
            pass
    return gen.get_state().numpy().tobytes()


def _input_device(args: tuple, kwargs: dict | None) -> torch.device:
    """The device of an op's first tensor input (top level or in a list), else the CPU."""
    for a in (*args, *(kwargs or {}).values()):
        for t in a if isinstance(a, (tuple, list)) else (a,):
            if isinstance(t, torch.Tensor):
                return t.device
    return _CPU


_CPU = torch.device("cpu")


def rng_before(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> tuple[Any, Any]:
    """(generator, mark) of the generator `func` would draw from, read before it runs."""
    gen = generator_of(func, args, kwargs, _input_device(args, kwargs))
    return gen, rng_mark(gen)


def rng_moved(before: tuple[Any, Any]) -> bool:
    """Whether the op run since `rng_before` drew from that generator: how random ops without
    torch's ``nondeterministic_seeded`` tag (flash-attn's and hub kernels' dropout, any custom
    op calling ``torch.rand``) are known. Asked while tracing and building slot tables, never
    on the hot path."""
    gen, mark = before
    return gen is not None and rng_mark(gen) != mark


# -- regions and keys -----------------------------------------------------------------------


class RegionTracker:
    """Knows which submodule of a block is running, via forward hooks on its submodules.

    The hooks push and pop the submodule's path (relative to the block); `current` is the innermost
    one, ``""`` for the block's own code. `remove()` takes every hook off again: the runtime
    installs them only for the forward that builds a block's slot table.
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


def region_of(key: str) -> str:
    """The region part of an op key (``"self_attn.q_proj/mm#0"`` -> ``"self_attn.q_proj"``)."""
    return key.rpartition("/")[0]
