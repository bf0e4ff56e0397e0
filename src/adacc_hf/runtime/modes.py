"""The two dispatch modes one checkpointed block forward runs under, and what they share.

In forward, `_KeepMode` keeps the output of every op its slot table retains (as is) or compresses
(encoded); in backward's recompute, `_ReplayMode` hands kept outputs back (decoded) instead of
running those ops, and runs every other op again. Both count keyed ops (`ops.key_kind`) and look
each one's slot up by position. A forward without a table is `_BuildMode`: it names every keyed
op through its region, aligns it with the policy and notes which ops move the RNG, and its slots
become the block's table for that call signature.

Random ops (tagged, or moving their generator while the table was built) may be kept: forward
notes the generator state after them and replay restores it, so the ops recomputed after them
draw the same numbers. A tensor that in-place ops fill before its first use (CPU dropout's noise)
is kept as it is at that first use; replay skips the fills, restoring the generator as each fill
left it. Nothing here waits for the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .kept import Entry, keep, park, release, unpack
from .ops import (
    IGNORED,
    KEYED,
    MUTABLE,
    OpKeyer,
    RegionTracker,
    device_of,
    draws_random,
    generator_of,
    key_kind,
    mutated_args,
    rng_before,
    rng_moved,
    tensor_outputs,
)
from .slots import Slot, SlotTable, build_table, make_slot, matches, observe


class _Run:
    """One checkpointed forward of one block: its kept outputs, by slot position."""

    def __init__(self, rt: Any, table: SlotTable | None, frame: Any = None) -> None:
        self.rt = rt  # the block's `checkpoint.BlockRuntime`
        self.table = table
        self.frame = frame  # where offloaded outputs are parked (`offload.Frame`; None: none)
        self.store: dict[int, Entry] = {}
        self.sizes: dict[int, tuple[str, int]] = {}  # position -> (key, bytes), outlives replay
        self.nbytes = 0
        self.built: SlotTable | None = None
        self.broken = ""

    def contexts(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        keep_mode = _KeepMode(self) if self.table is not None else _BuildMode(self)
        return keep_mode, _ReplayMode(self)

    def drop(self, keep=lambda e: False) -> None:
        for pos in [p for p, e in self.store.items() if not keep(e)]:
            e = self.store.pop(pos)
            release(self.rt, e)
            self.nbytes -= e.nbytes
            del self.sizes[pos]

    def misaligned(self, detail: str) -> None:
        """The forward left the table's op sequence: keep nothing from this run."""
        if not self.broken:
            self.broken = detail
            self.drop()
            self.rt.warn(
                "misaligned:" + detail,
                f"{detail}; this forward keeps nothing (recomputed), the slot table is rebuilt",
            )


_entered = [0]  # runtime modes entered now: every op issued meanwhile crosses them


def crossings() -> int:
    """How many of the runtime's dispatch modes an op issued now crosses (a modelled device
    charges each crossing's host time: `devices.roofline`)."""
    return _entered[0]


class _InHandler:
    """Around the runtime's own work inside a mode's handler (keeping or handing back an
    output): the ops it issues do not cross the mode, which is off while its handler runs."""

    def __enter__(self) -> None:
        _entered[0] -= 1

    def __exit__(self, *exc: object) -> None:
        _entered[0] += 1


_IN_HANDLER = _InHandler()


class _FastMode(TorchDispatchMode):
    """A dispatch mode without torch's per-op ``_disable_dynamo`` wrapper (``set_eval_frame``
    twice per op, about half the crossing's cost). Safe here: under torch.compile blocks run
    selective-checkpoint tags (`compiled`), never these modes."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __enter__(self):
        _entered[0] += 1
        return super().__enter__()

    def __exit__(self, *exc):
        _entered[0] -= 1
        return super().__exit__(*exc)


class _KeepMode(_FastMode):
    """Forward: keep what the slot table says."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run
        self.pos = 0
        # data_ptr -> (position, slot, tensor, fills) of outputs in-place ops are still filling
        self.pending: dict[int, tuple[int, Slot, torch.Tensor, list]] = {}
        self.slots = run.table.slots if run.table is not None else None
        self.tracker = run.rt.tracker

    def __exit__(self, *exc):
        res = super().__exit__(*exc)
        interrupted = exc[0] is not None  # the forward raised (out of memory): it is not re-run
        if not interrupted:
            for p in list(self.pending.values()):
                self._store(*p)
        self.pending.clear()
        if interrupted:
            self.run.drop()  # keeps nothing, builds no table, and has nothing to warn about
        self._finish(interrupted)
        return res

    def _finish(self, interrupted: bool) -> None:
        run = self.run
        if not interrupted and not run.broken and self.pos != len(self.slots):
            run.misaligned(f"{self.pos} keyed ops ran where the slot table has {len(self.slots)}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The hot path: one op call, the key rule (one dict lookup), then out for most ops.
        out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        kind = key_kind(func, args, kwargs)
        if kind == MUTABLE:
            if self.pending:
                self._filled(func, args, kwargs)
            return out
        if self.pending and func not in IGNORED:
            self._read(args)
        if kind != KEYED:
            return out
        pos = self.pos
        self.pos = pos + 1
        if self.slots is None:
            slot = self._build_slot(func, out)
        elif self.run.broken:
            return out
        elif pos >= len(self.slots) or self.slots[pos].func is not func:
            self.run.misaligned(f"op {func} at keyed position {pos} is not the slot table's")
            return out
        else:
            slot = self.slots[pos]
        if slot.action is None:
            if self.tracker is not None:
                self.tracker.observe(self.run.rt.group, slot.key, out, None)
            return out
        fills: list = []
        if slot.random:
            gen = generator_of(func, args, kwargs, device_of(args, out))
            fills.append((gen, gen.get_state()) if gen is not None else None)
        if slot.fill:  # kept at its first use, once the in-place ops have filled it
            t = tensor_outputs(out)[0]
            self.pending[t.data_ptr()] = (pos, slot, t, fills)
        else:
            self._store(pos, slot, out, fills)
        return out

    def _store(self, pos: int, slot: Slot, out: Any, rng: list) -> None:
        with _IN_HANDLER:
            e = keep(self.run.rt, slot, out)
        e.rng = rng
        if self.tracker is not None:
            self.tracker.observe(self.run.rt.group, slot.key, out, e.enc[0] if e.enc else None)
        if slot.offload and self.run.frame is not None:
            park(self.run.rt.host, self.run.frame, e)
        self.run.store[pos] = e
        self.run.sizes[pos] = (slot.key, e.nbytes)
        self.run.nbytes += e.nbytes

    def _filled(self, func, args, kwargs) -> None:
        """An in-place op wrote a kept tensor before its first use: note the generator state
        after it (any fill may draw random numbers, tagged or not), which replay restores."""
        for t in mutated_args(func, args, kwargs):
            p = self.pending.get(t.data_ptr())
            if p is not None:
                gen = generator_of(func, args, kwargs, t.device)
                p[3].append((gen, gen.get_state()) if gen is not None else None)

    def _read(self, args: tuple) -> None:
        for a in args:
            for t in a if isinstance(a, (tuple, list)) else (a,):
                if isinstance(t, torch.Tensor):
                    p = self.pending.pop(t.data_ptr(), None)
                    if p is not None:
                        self._store(*p)

    def _build_slot(self, func, out) -> Slot:
        raise AssertionError("only _BuildMode runs without a slot table")


class _BuildMode(_KeepMode):
    """The forward that builds a block's slot table: names ops through their regions (hooks on
    every submodule, string keys) and notes which keyed ops move their generator, this once."""

    def __init__(self, run: _Run) -> None:
        super().__init__(run)
        self.keyer: OpKeyer | None = None
        self.seen: list = []
        self.rng: tuple[Any, Any] | None = None
        self.draws = False  # the running keyed call draws by torch's tag (`draws_random`)

    def __enter__(self):
        self.keyer = OpKeyer(RegionTracker(self.run.rt.block))
        return super().__enter__()

    def _finish(self, interrupted: bool) -> None:
        run, rt = self.run, self.run.rt
        self.keyer.regions.remove()
        if interrupted:
            return
        table = build_table(rt.specs, self.seen, rt.actions, rt.codec)
        kept = {s.key for s in table.slots if s.action is not None}
        run.drop(lambda e: e.slot.key in kept)  # misaligned regions keep nothing
        for problem in table.problems:
            rt.warn("region:" + problem, problem)
        rt.unknown |= table.unknown
        run.built = table

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        keyed = key_kind(func, args, kwargs) == KEYED
        self.rng = rng_before(func, args, kwargs) if keyed else None
        self.draws = keyed and draws_random(func, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _build_slot(self, func, out) -> Slot:
        rt = self.run.rt
        key, _, _ = self.keyer.key(func)
        random = self.draws or (self.rng is not None and rng_moved(self.rng))
        seen = observe(func, key, tensor_outputs(out), random)
        self.seen.append(seen)
        spec = rt._spec.get(key)
        if spec is None or not matches(spec, seen):
            return Slot(func, key, random=random)
        return make_slot(func, key, spec, rt.actions.get(key), rt.codec, random)


class _ReplayMode(_FastMode):
    """Recompute: hand kept outputs back instead of running their ops; skip the fills of kept
    filled tensors, restoring the RNG as each fill left it."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run
        self.pos = 0
        self.skip: dict[int, list] = {}

    def __enter__(self):
        if self.run.frame is not None:  # stage what it parked, prefetch the block before it
            self.run.rt.host.begin_backward(self.run.frame)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.run.store or self.skip:  # else nothing is left to hand back or skip
            kind = key_kind(func, args, kwargs)
            if kind == KEYED and self.run.store:
                pos = self.pos
                self.pos = pos + 1
                e = self.run.store.pop(pos, None)
                if e is not None:
                    if e.slot.func is func:
                        with _IN_HANDLER:
                            out = unpack(self.run.rt, e, args)
                        if e.slot.fill and e.rng:
                            self.skip[out.data_ptr()] = list(e.rng)
                        return out
                    # The recompute left forward's op sequence: nothing after this point can
                    # be matched safely, so everything from here on is recomputed.
                    self.run.drop()
                    self.run.rt.warn(
                        "replay:" + e.slot.key,
                        f"recompute ran {func} where forward kept {e.slot.key}; recomputing "
                        "the rest of the block",
                    )
            elif kind == MUTABLE and self.skip:
                for t in mutated_args(func, args, kwargs):
                    fills = self.skip.get(t.data_ptr())
                    if fills is not None:
                        state = fills.pop(0)
                        if state is not None:
                            state[0].set_state(state[1])
                        if not fills:
                            del self.skip[t.data_ptr()]
                        # the fill happened in forward: the kept tensor is its result
                        return t if func._schema.returns else None
        return func._op(*args, **kwargs) if kwargs else func._op(*args)
