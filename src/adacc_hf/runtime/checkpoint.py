"""The per-block checkpoint that retains, compresses or recomputes each op's output.

One mechanism: transformers' per-layer checkpoint hook (`GradientCheckpointingLayer`) calls
`BlockRuntime`, which runs torch's non-reentrant checkpoint. A block whose policy keeps nothing
runs it exactly as transformers' full checkpointing does (no dispatch modes at all). Otherwise two
dispatch modes (`modes.py`) run beside it: forward keeps the output of every op the policy retains
(as is) or compresses (encoded); backward's recompute hands kept outputs back (decoded) instead of
running those ops, and runs every other op again. What the policy offloads (ops, and the block's
input: what the checkpoint holds to start its recompute from) is parked in host memory in between
(`offload.HostStore`, one frame per block forward).

Both modes walk the block's slot table (`slots.py`): position -> action, built once per (policy
op list, variant, call signature) and kept across policy switches (per-bucket plans), at most
`MAX_TABLES` per block. Nothing here waits for the device.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..codecs import Codec, get_codec
from ..errors import AdaccError
from ..schema import Action, GroupPolicy, Variant
from .compiled import compile_refusal, contexts, wanted
from .compiled import refuse as compiled_refusal
from .modes import _Run
from .offload import Frame, HostStore
from .peak import AllocationTracker
from .slots import SlotTable, call_signature, spec_signature

logger = logging.getLogger("adacc_hf")
MAX_TABLES = 64  # slot tables kept per block (op list, variant, call signature), oldest out
_COMPILE_MSG = (
    "an adacc block ran eagerly inside a compiled model (a graph break at the block): its eager "
    "runtime is a pair of Python dispatch modes the compiled model's ops were not planned for. "
    "Compile the whole model or its blocks without graph breaks (torch._dynamo.explain names "
    "them), or leave torch.compile off; see docs/compile.md"
)


#: Every distinct (op list, kept ops, input offload) a runtime ran, numbered for dynamo's guards.
_VERSIONS: dict[tuple, int] = {}
_OWN_RUNS = [0]  # >0 while adacc runs blocks itself (planning inside a compiled model's hook)


@contextlib.contextmanager
def own_eager_runs() -> Iterator[None]:
    """Block calls of adacc's own (profiling, timing): eager even inside a compiled model."""
    _OWN_RUNS[0] += 1
    try:
        yield
    finally:
        _OWN_RUNS[0] -= 1


def _eager_in_compiled(*modules: Any) -> bool:
    """Whether this eager call comes from inside ``torch.compile``: an eager fallback inside a
    compiled module (``torch.compile(model)``), or one of `modules` compiled in place
    (``model.compile()``, ``layer.compile()``); never adacc's own runs."""
    if _OWN_RUNS[0]:
        return False
    ef = sys.modules.get("torch._dynamo.eval_frame")
    if ef is not None and getattr(ef, "_is_in_optimized_module", lambda: False)():
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in modules)


class BlockRuntime:
    """Runs one block under one variant of its group's policy; installed as its checkpoint fn."""

    def __init__(
        self,
        block: nn.Module,
        path: str,
        group: str,
        gp: GroupPolicy,
        variant: Variant,
        warned: set,
        planned_for_compile: bool = False,
    ) -> None:
        self.block = block
        self.root: Any = None  # the patched model (set by apply): compiled later -> an error
        self.path = path
        self.group = group
        self.specs: list = []
        self.unknown: set[str] = set()  # ops recomputed because the policy does not describe them
        self.problems: list[str] = []
        self._warned = warned  # shared by every block of one handle: one warning per problem
        self.tracker: Any = None  # an evolution.OutlierTracker during tracking steps
        self.last_nbytes = 0
        self.last_bytes: dict[str, int] = {}  # per kept op of the last forward (before sharing)
        self.bitpack = get_codec("bitpack")
        self._codecs: dict[Any, Codec] = {"bitpack": self.bitpack}
        self._tables: dict[tuple, SlotTable] = {}
        self._spec_ids: dict[tuple, int] = {}  # `spec_signature` -> a small id for table keys
        self._skey = 0
        self._unstable: set[tuple] = set()  # signatures whose op sequence changed in a bucket
        self.host: HostStore | None = None  # set by apply where a policy offloads anything
        self.version = 0  # the variant's number (op list and kept ops): compiled graphs guard on it
        # the policy was planned from a compile profile: its compile contexts do not warn
        self.planned_for_compile = planned_for_compile
        self._sig: tuple = ()
        self.set_variant(variant, gp)

    def set_variant(self, variant: Variant, gp: GroupPolicy | None = None) -> None:
        """Run another variant, or another op list ``gp.ops`` (another trace: the plan of another
        bucket). Tables are kept per op list and variant: switching back rebuilds nothing."""
        if gp is not None and list(gp.ops) != self.specs:
            self.specs = list(gp.ops)
            self._spec = {s.key: s for s in self.specs}
            self._sig = spec_signature(self.specs)
            self._skey = self._spec_ids.setdefault(self._sig, len(self._spec_ids))
        self.actions: dict[str, Action] = dict(variant.actions)
        self._vkey = tuple(sorted((k, a) for k, a in self.actions.items() if a.kind != "recompute"))
        self.keeps_any = bool(self._vkey)
        self.offload_input = variant.offload_input
        self.offloads = variant.offloads
        # the same variant again (a bucket planned before, or another block: compiled on its own,
        # blocks share their code) has the same number in every runtime: its compiled graph is
        # still in dynamo's cache, so switching back recompiles nothing
        key = (self._sig, self._vkey, self.offload_input)
        self.version = _VERSIONS.setdefault(key, len(_VERSIONS) + 1)
        # under torch.compile: the retained ops as selective-checkpoint tags (`compiled`), or why
        # the variant has no such form
        self._tags = functools.partial(
            contexts, wanted(self.specs, self.actions), not self.planned_for_compile
        )
        self._refusal = compile_refusal(
            self.path, self.actions, self.offload_input, self.planned_for_compile
        )

    def codec(self, action: Action) -> Codec:
        c = self._codecs.get(action)
        if c is None:
            c = self._codecs[action] = get_codec(action.codec, **action.codec_kwargs)
            self._codecs[c.name] = c
        return c

    def codec_of(self, name: str) -> Codec:
        return self._codecs[name]

    def remove(self) -> None:
        self._tables.clear()
        self._unstable.clear()

    def __call__(self, fn, *args):
        if torch.compiler.is_compiling():  # the model or the block itself is being compiled
            return self._compiled(fn, args)
        if _eager_in_compiled(self.root, self.block):
            # dynamo fell back to eager here (a graph break; a raise traced too)
            raise compiled_refusal(self._refusal) if self._refusal else AdaccError(_COMPILE_MSG)
        if not self.offloads or not torch.is_grad_enabled():
            return self._run(fn, args, None)
        if self.host is None:
            raise AdaccError(f"block {self.path}: its policy offloads but no host store was set")
        frame = self.host.frame()
        if not self.offload_input:
            return self._run(fn, args, frame)
        with self._parked_input(frame, args):
            return self._run(fn, args, frame)

    def _compiled(self, fn, args: tuple):
        """Traced by torch.compile: the variant as selective-checkpoint tags (`compiled`). The
        variant's number is read here, so dynamo guards on it: a new policy recompiles."""
        if self.version < 0:  # never: the read is what makes the guard
            raise AssertionError
        if self._refusal is not None:
            raise compiled_refusal(self._refusal)
        if not self.keeps_any:
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
        return checkpoint(
            fn, *args, use_reentrant=False, context_fn=self._tags, preserve_rng_state=True
        )

    def _parked_input(self, frame: Frame, args: tuple) -> Any:
        """Park the block's input (its first positional tensor: the hidden states) where the
        checkpoint saves it for the recompute; other inputs (masks, position embeddings, shared
        by every block) stay where they are."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not x.is_floating_point():
            return contextlib.nullcontext()
        host = self.host
        target = (x.data_ptr(), x.shape, x.dtype)

        def pack(t: torch.Tensor) -> Any:
            if (t.data_ptr(), t.shape, t.dtype) != target:
                return t
            return host.park(frame, t.detach())

        def unpack(p: Any) -> torch.Tensor:  # autograd restores the input's grad metadata
            return host.fetch(frame, p)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _run(self, fn, args: tuple, frame: Frame | None):
        tracking = self.tracker is not None
        sig: tuple | None = None
        table = None
        if self.keeps_any or tracking:
            sig = (self._skey, self._vkey, call_signature(fn, args))
            if sig in self._unstable:  # its op sequence changes within the bucket
                sig = (*sig, call_signature(fn, args, exact=True))
            table = self._tables.get(sig)
        if not tracking and (not self.keeps_any or (table is not None and not table.caches)):
            # nothing to keep: exactly transformers' full checkpointing, no dispatch modes
            self.last_nbytes, self.last_bytes = 0, {}
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
        run = _Run(self, table, frame)
        out = checkpoint(
            fn, *args, use_reentrant=False, context_fn=run.contexts, preserve_rng_state=True
        )
        if run.built is not None:
            if len(self._tables) >= MAX_TABLES:  # e.g. many padded lengths: drop the oldest
                self._tables.pop(next(iter(self._tables)))
            self._tables[sig] = run.built
        elif run.broken:
            self._tables.pop(sig, None)  # rebuilt (and re-aligned) on the next forward
            if len(sig) == 3:  # the bucket's lengths run different ops: key by exact sizes
                self._unstable.add(sig)
        # A retained output that is the block's own output costs nothing extra: the next block
        # (or the final norm) holds it anyway.
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))]
        ptrs = {t.data_ptr() for t in outs if isinstance(t, torch.Tensor) and t.numel()}
        for e in run.store.values():
            for v, _ in e.versions:
                if v.numel() and v.data_ptr() in ptrs:
                    run.nbytes -= v.numel() * v.element_size()
        self.last_nbytes = run.nbytes
        self.last_bytes = dict(run.sizes.values())
        return out

    def warn(self, what: str, detail: str) -> None:
        line = f"{self.path}: {detail}"
        if line not in self.problems:  # a long run repeats its problems: list each once
            self.problems.append(line)
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("adacc: block %s: %s", self.path, detail)


@functools.cache
def frame_nbytes(device_type: str) -> int:
    """Bytes one checkpointed block holds on a `device_type` device besides the tensors it saves:
    torch's checkpoint stashes the generators' states to replay dropout in recompute
    (``preserve_rng_state``). Those are host tensors, so they count only where the device is the
    host (CPU: its generator's state, measured here with the step meter on one tiny checkpoint)."""
    if device_type != "cpu":
        return 0
    x = torch.zeros(64, requires_grad=True)
    with torch.enable_grad(), AllocationTracker("cpu") as tracker:
        y = checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state=True)
        tracker.mark("held")
    return max(0, tracker.level("held") - y.untyped_storage().nbytes())
