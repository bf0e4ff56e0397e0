"""Slot tables: what the runtime does at each position of a block's forward, built once.

The keyed ops of a block run in the same order on every forward whose inputs have the same
dtypes, ranks and autocast and whose sizes fall in the same buckets (`call_signature`): under
dynamic padding, every length of a bucket. A `SlotTable` maps each position in that order to a
`Slot`: the op overload expected there and what to do with its output (nothing, keep it raw, keep
it encoded, keep only its mask); nothing in it depends on sizes. The runtime builds one per
(policy op list, variant, call signature) on the first forward that sees it; every later forward
just counts keyed ops and looks their slots up: no string formatting, no region hooks, no per-op
allocation. A different op at a position, or a different op count, means the table does not
describe this forward: the run keeps nothing and the table is rebuilt on the next forward; a
signature that saw its op sequence change so (a block branching on the exact length) is keyed by
exact sizes from then on.

Building aligns what the forward ran with the policy's op list region by region (a region is a
submodule of the block). A region whose ops differ from the policy's in number, key or signature
(op overload, output dtype, shape class) gets no actions at all, with a warning: a policy traced
on a block with one op more or fewer never acts on an op that merely took another's key.

A router region (`ALWAYS_RETAIN` layer types) the policy retains but that does not align is the
one region that cannot simply be recomputed: backward's recompute would run the router on inputs
the block's lossy codecs altered and could route tokens to other experts than forward did (a
forward hook on the router that runs an op is enough to misalign it). Such a block keeps nothing
lossy: its retained and bit-packed outputs are exact, so the recomputed router sees forward's
inputs bit for bit.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codecs import Codec
from ..schema import ALWAYS_RETAIN, RECOMPUTE, Action, OpSpec
from ..schema.buckets import bucket_edge
from .ops import NATIVE_DROPOUT, region_of, shape_class

# How a slot keeps an op's output.
RAW, PACKED, MASK_ONLY = 0, 1, 2


@dataclass(eq=False)
class Slot:
    """One keyed op position of a block forward."""

    func: Any  # the op overload expected at this position
    key: str
    action: Action | None = None  # None: nothing is kept (recomputed in backward)
    store: int = RAW  # RAW (retain), PACKED (compress), MASK_ONLY (native_dropout's mask)
    codec: Codec | None = None
    fill: bool = False  # the output is completed by in-place RNG fills before its first read
    random: bool = False  # the op draws from an RNG: replay restores the state after it
    offload: bool = False  # kept in host memory until backward (`offload.HostStore`)
    single: bool = True  # the op returns one value (else a tuple)

    def __post_init__(self) -> None:
        self.single = len(self.func._schema.returns) == 1


@dataclass(eq=False)
class SlotTable:
    slots: list[Slot]
    problems: list[str] = field(default_factory=list)  # regions the policy does not describe
    unknown: set[str] = field(default_factory=set)  # keys of the ops those regions ran

    @property
    def caches(self) -> bool:
        return any(s.action is not None for s in self.slots)


@dataclass
class Observed:
    """A keyed op as the table-building forward saw it."""

    func: Any
    key: str
    dtype: str
    ranks: str
    random: bool = False  # tagged random, or its generator moved across it


def observe(func: Any, key: str, tensors: list[torch.Tensor], random: bool = False) -> Observed:
    dtype = str(tensors[0].dtype) if tensors else ""
    return Observed(func, key, dtype, shape_class(tensors), random)


def matches(spec: OpSpec, seen: Observed) -> bool:
    """Whether the op seen has the policy op's signature (fields the policy left empty, from
    before signatures were recorded, are not checked)."""
    return (
        spec.key == seen.key
        and (not spec.aten or spec.aten == str(seen.func))
        and spec.dtype == seen.dtype
        and (not spec.shape_class or spec.shape_class == seen.ranks)
    )


def _describe(spec: OpSpec | None, seen: Observed | None) -> str:
    want = "nothing"
    if spec is not None:
        want = f"{spec.key} ({spec.aten or '?'}, {spec.dtype}, rank {spec.shape_class or '?'})"
    got = f"{seen.key} ({seen.func}, {seen.dtype}, rank {seen.ranks})" if seen else "nothing"
    return f"the policy has {want}, the block ran {got}"


def misaligned_regions(specs: list[OpSpec], seen: list[Observed]) -> dict[str, str]:
    """Regions whose op sequence differs from the policy's, each with its first difference."""
    want: dict[str, list[OpSpec]] = defaultdict(list)
    got: dict[str, list[Observed]] = defaultdict(list)
    for spec in specs:
        want[region_of(spec.key)].append(spec)
    for o in seen:
        got[region_of(o.key)].append(o)
    bad = {}
    for region in sorted(set(want) | set(got)):
        a, b = want.get(region, []), got.get(region, [])
        for i in range(max(len(a), len(b))):
            sa = a[i] if i < len(a) else None
            sb = b[i] if i < len(b) else None
            if sa is None or sb is None or not matches(sa, sb):
                bad[region] = _describe(sa, sb)
                break
    return bad


def make_slot(
    func: Any, key: str, spec: OpSpec, action: Action | None, codec: Any, random: bool
) -> Slot:
    """The slot of one op whose signature matched; ``codec(action)`` builds the action's codec;
    `random`: the op draws from an RNG (`Observed.random`)."""
    slot = Slot(func, key, random=random)
    slot.fill = spec.mask and not slot.random  # CPU dropout: a tensor an RNG op fills
    if action is None or action.kind == "recompute" or not spec.cacheable:
        return slot
    slot.action = action
    slot.offload = action.offloaded
    if action.codec is not None:
        slot.codec = codec(action)
        slot.store = MASK_ONLY if (func is NATIVE_DROPOUT and spec.mask) else PACKED
    return slot


def build_table(
    specs: list[OpSpec], seen: list[Observed], actions: dict[str, Action], codec: Any
) -> SlotTable:
    """The table for the op sequence ``seen``: policy actions for the ops of every region that
    matches the policy exactly, nothing for the others (listed in ``problems``). When a router
    region the policy retains ran but does not match, no slot of the block keeps a lossy
    encoding (see the module docstring)."""
    by_key = {s.key: s for s in specs}
    bad = misaligned_regions(specs, seen)
    slots, unknown = [], set()
    for o in seen:
        spec = by_key.get(o.key)
        if spec is None or region_of(o.key) in bad:
            slots.append(Slot(o.func, o.key, random=o.random))
            unknown.add(o.key)
            continue
        slots.append(make_slot(o.func, o.key, spec, actions.get(o.key), codec, o.random))
    problems = [
        f"region {r or '(block)'!r}: {why}; its ops are recomputed"
        for r, why in sorted(bad.items())
    ]
    lost = _unretained_routers(specs, seen, actions, bad)
    if lost:
        lossy = [s for s in slots if s.codec is not None and not s.codec.lossless]
        for s in lossy:
            s.action, s.store, s.codec = None, RAW, None
        problems.append(
            f"router region(s) {', '.join(map(repr, lost))} cannot be retained as the policy "
            f"says: the block's {len(lossy)} lossy op(s) are recomputed instead, so that "
            "backward's recompute routes tokens as forward did"
        )
    return SlotTable(slots, problems, unknown)


def _unretained_routers(
    specs: list[OpSpec], seen: list[Observed], actions: dict[str, Action], bad: dict[str, str]
) -> list[str]:
    """Misaligned regions that ran and hold a router op the policy retains."""
    ran = {region_of(o.key) for o in seen}
    return sorted(
        {
            region_of(s.key)
            for s in specs
            if s.layer_type in ALWAYS_RETAIN
            and s.cacheable
            and actions.get(s.key, RECOMPUTE).kind != "recompute"
            and region_of(s.key) in bad
            and region_of(s.key) in ran
        }
    )


_edge = functools.lru_cache(maxsize=4096)(bucket_edge)


def _sig(v: Any, exact: bool) -> Any:
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape) if exact else tuple(map(_edge, v.shape))
        return (shape, v.dtype, v.device, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return tuple(_sig(x, exact) for x in v)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and not exact:
        return ("n", _edge(v))  # a length (padding-free attention's max_length_q)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__name__


def call_signature(fn: Any, args: tuple, exact: bool = False) -> tuple:
    """What decides a block's op sequence, the key of its slot tables: the dtypes, devices and
    ranks of its tensor arguments (positional and the keywords transformers binds into ``fn``),
    their sizes and the integers rounded up to their bucket (`bucket_edge`), other plain values,
    autocast. Under dynamic padding every length of a bucket shares one table. Correctness never
    rests on the key: a table that does not describe the ops that run is detected, and that run
    keeps nothing. ``exact=True``: sizes and integers as they are (for a block whose op sequence
    changes within a bucket)."""
    parts: list[Any] = [_sig(a, exact) for a in args]
    for k, v in sorted((getattr(fn, "keywords", None) or {}).items()):
        parts.append((k, _sig(v, exact)))
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None:
        dev = first.device.type
        if torch.is_autocast_enabled(dev):
            parts.append(("autocast", dev, torch.get_autocast_dtype(dev)))
    return tuple(parts)


def spec_signature(specs: list[OpSpec]) -> tuple:
    """What of a policy's op list a slot table depends on (`matches`, `make_slot`, routers): the
    same for the per-bucket plans of one block, whose op lists differ in shapes only."""
    return tuple(
        (s.key, s.aten, s.dtype, s.shape_class, s.mask, s.cacheable, s.layer_type) for s in specs
    )
