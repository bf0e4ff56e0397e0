"""A training step run without its arithmetic, on a modelled device's clock.

`DryRun` is a dispatch mode that executes no kernel: every op's outputs are allocated with the
sizes, strides and dtypes the op's meta implementation gives, in real host memory, and left
uninitialised (untouched pages cost nothing). So every measurement the library makes of memory
(the allocator events `runtime.peak` replays, the storages `runtime.memory` counts) reads what the
step allocates, exactly as it would with the arithmetic; a 1.1B-parameter LLaMA step at 4 x 2048
tokens runs in seconds. What runs for real: views (they allocate nothing), ops on small
tensors (``SMALL`` elements: scalars, step counters, RNG seeds) or with small outputs from
computed values (a sum, a gathered element), random ops (they move the
generator as the run does: dropout masks are replayed from its states) and ops with integer or bool
outputs whose inputs hold computed values (token ids, positions, padding masks: what the step's
Python reads). Every other output holds no computed value, and neither does anything made from
one (tensors are marked so); in-place ops on them leave them as they were. A custom op written in
Python (torch's chunked linear cross-entropy) runs its implementation, so its temporaries show;
an op without a meta implementation runs for real (counted in ``DryRun.real``).

Each op also advances a modelled clock (`roofline`): the host issues ops one after the other
(``host_s``: a fixed cost per op, more per op crossing the runtime's dispatch modes), the device
runs each kernel once it is issued and the previous one is done (``device_s``). ``clock()`` is the
time at which everything issued so far has finished: the wall time a synchronised timer reads on
the device the table models. `runtime.timing` reads it while a dry run is on (`modelled`).

Values are garbage: a data-dependent branch of the step's own Python takes an arbitrary side, so
only steps whose control flow does not read activation values are modelled (transformers'
causal LMs without padding; the runtime reads none).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..codecs import backends
from ..runtime import timing
from ..runtime.modes import crossings
from ..runtime.ops import draws_random
from .roofline import Roofline, op_bytes, op_flops

__all__ = ["SMALL", "DryRun", "dry_run", "replay"]

#: Ops whose tensors all have at most this many elements run for real.
SMALL = 4096
#: Ops that only allocate: no kernel runs on a device.
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.device.type != "meta":
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    return t


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any] | None:
    """The arguments an in-place / out= op writes (None: it writes none)."""
    schema = func._schema
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None)
    return out or None


class DryRun(TorchDispatchMode):
    """The dispatch mode of the module docstring; `roofline` prices each op (None: no clock)."""

    def __init__(self, roofline: Roofline | None = None) -> None:
        super().__init__()
        self.roofline = roofline
        self.host_s = 0.0
        self.device_s = 0.0
        self.ops = 0
        self.kernels = 0
        self.real: dict[str, int] = {}  # ops run for real for want of a meta implementation
        self._metas: dict[tuple, tuple[Any, bool]] = {}
        self.suspended = 0  # inside a call priced as a whole (a codec's): its ops cost nothing
        self.trace: list[tuple[int, str | None, float, float]] | None = None

    def clock(self) -> float:
        """Modelled seconds until everything issued so far is done."""
        return max(self.host_s, self.device_s)

    def queue(self) -> float:
        """Modelled seconds until the device has run every kernel issued so far."""
        return self.device_s

    def synchronize(self) -> None:
        """The host waits until the device has run everything issued."""
        self.host_s = self.device_s = self.clock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out, kernel = self._run(func, args, kwargs)
        if self.roofline is not None and not self.suspended:
            if kernel:
                kind, flops = op_flops(func, args, kwargs, out)
                self.issue(kind, flops, op_bytes(args, kwargs, out))
            else:
                self.issue(None)
        return out

    def issue(self, kind: str | None, flops: float = 0.0, nbytes: float = 0.0) -> None:
        """Advance the clock by one op: the host issues it, the device runs its kernel (`kind`:
        ``matmul`` / ``attention`` / ``memory``, or ``codec`` with `flops` its seconds; None:
        no kernel). With ``trace`` on, the op is recorded for `replay`."""
        assert self.roofline is not None
        n = crossings()
        self.ops += 1
        self.host_s += self.roofline.host_s(n)
        if self.trace is not None:
            self.trace.append((n, kind, flops, nbytes))
        if kind is None:
            return
        self.kernels += 1
        seconds = flops if kind == "codec" else self.roofline.seconds(kind, flops, nbytes)
        self.device_s = max(self.device_s, self.host_s) + seconds

    def _run(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """(outputs, whether the op launches a kernel on a device)."""
        inputs = _tensors((args, kwargs))
        garbage = any(_is_garbage(t) for t in inputs)
        kernel = func._schema.name.split("::")[-1] not in _ALLOCATIONS
        impl = _python_impl(func)
        if impl is not None:  # a custom op written in torch: its ops run dry, one by one
            with self:
                return impl(*args, **kwargs), False
        aliases = func.is_view or any(r.alias_info is not None for r in func._schema.returns)
        if aliases and _written(func, args, kwargs) is None:  # a view: nothing allocated
            return _marked(func(*args, **kwargs), garbage), False
        got = self._meta_outputs(func, args, kwargs)
        if got is None:  # no meta implementation (or data-dependent): real
            name = str(func)
            self.real[name] = self.real.get(name, 0) + 1
            return _marked(func(*args, **kwargs), garbage), kernel
        meta_out, aliases = got
        outs = _tensors(meta_out)
        written = _written(func, args, kwargs)
        targets = _tensors(written)
        # what a random op draws is as a run draws it (the runtime replays generator states);
        # an in-place draw (CPU dropout's noise) replaces every value of its tensor
        random = draws_random(func, args, kwargs)  # not attention without dropout
        drawn = random and bool(targets)
        others = [t for t in inputs if not any(t is w for w in targets)]
        # integer and bool tensors made from real values (ids, positions, padding masks) are
        # what the step's Python branches on; a real tensor changed in place by real values
        # stays real (the noise of dropout scaled: the profiler reads it is a 0-or-scale mask)
        exact = not garbage and (not any(t.is_floating_point() for t in outs) or bool(targets))
        small = all(t.numel() <= SMALL for t in outs) and (
            not garbage or all(t.numel() <= SMALL for t in inputs)
        )
        if small or exact or random:
            out = func(*args, **kwargs)
            fake = any(_is_garbage(t) for t in others) if drawn else garbage
            for t in targets:
                _mark(t, fake)
            return _marked(out, fake), kernel
        for t in _tensors(written):
            _mark(t)
        if written is not None:  # in place / out=: the tensors stay as they were
            if not func._schema.returns:
                return None, True
            return (written[0] if len(func._schema.returns) == 1 else tuple(written)), True
        if aliases:
            return _marked(func(*args, **kwargs), garbage), False  # a view without alias info
        device = kwargs.get("device") or (inputs[0].device if inputs else torch.device("cpu"))

        def alloc(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
            return t

        return _marked(tree_map(alloc, meta_out), True), kernel

    def _meta_outputs(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, bool] | None:
        """The op's outputs on the meta device and whether one aliases an input (cached by the
        arguments' sizes, strides and dtypes: a step repeats each op signature many times)."""
        key = _signature(func, args, kwargs)
        if key is not None and key in self._metas:
            return self._metas[key]
        try:
            margs, mkwargs = tree_map(_meta, (args, kwargs))
            if mkwargs.get("device") is not None:
                mkwargs["device"] = "meta"
            meta_out = func(*margs, **mkwargs)
        except Exception:
            return None
        metas = {t.untyped_storage()._cdata for t in _tensors((margs, mkwargs))}
        got = meta_out, any(t.untyped_storage()._cdata in metas for t in _tensors(meta_out))
        if key is not None:
            self._metas[key] = got
        return got


def _python_impl(func: Any) -> Any:
    """The Python implementation of a custom op (``torch.library.custom_op``; torch's chunked
    linear cross-entropy is one), whose temporaries its meta implementation does not show."""
    if func.namespace in ("aten", "prims"):
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    return getattr(opdef, "_init_fn", None) if opdef is not None else None


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of an op call's shapes and constants (None: not hashable)."""

    def sig(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.stride(), v.dtype, v.device.type)
        if isinstance(v, (list, tuple)):
            return tuple(sig(x) for x in v)
        return v

    try:
        key = (func, sig(args), tuple(sorted((k, sig(v)) for k, v in kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


_GARBAGE = "_adacc_dry_garbage"


def _is_garbage(t: torch.Tensor) -> bool:
    return getattr(t, _GARBAGE, False)


def _mark(t: torch.Tensor, garbage: bool = True) -> None:
    setattr(t, _GARBAGE, garbage)


def _marked(out: Any, garbage: bool) -> Any:
    """`out`, its tensors marked as holding no computed values where `garbage`."""
    if garbage:
        for t in _tensors(out):
            _mark(t)
    return out


@contextmanager
def dry_run(roofline: Roofline | None = None) -> Iterator[DryRun]:
    """Run the body as a dry run (module docstring); with `roofline`, `runtime.timing` reads the
    modelled clock meanwhile (and `roofline`'s codec and link figures), and every codec call is
    charged as a whole from the table (`codec_call`) while its reference runs dry."""
    mode = DryRun(roofline)
    if roofline is None:
        with mode:
            yield mode
        return
    pricer = partial(codec_call, mode, roofline)
    with (
        mode,
        timing.modelled(mode.clock, roofline, mode.synchronize, mode.queue),
        backends.priced(pricer),
    ):
        yield mode


@contextmanager
def codec_call(
    mode: DryRun, roofline: Roofline, codec: Any, what: str, shape: Any, dtype: torch.dtype
) -> Iterator[None]:
    """One codec call on the modelled clock: its ops free, then one host issue and the table's
    time of the backend the codec names (unnamed: the Triton kernels, as on a GPU)."""
    mode.suspended += 1
    try:
        yield
    finally:
        mode.suspended -= 1
    numel = math.prod(shape) if len(shape) else 1
    in_nbytes = numel * torch.empty((), dtype=dtype).element_size()
    got = None
    for backend in (codec.backend or "triton", "triton", "torch", "modelled"):
        got = roofline.codec_ms(codec.name, backend, in_nbytes, codec.predict_nbytes(shape, dtype))
        if got is not None:
            break
    ms = (got[0] if what == "encode" else got[1]) if got is not None else 0.0
    mode.issue("codec", ms * 1e-3)


def replay(
    trace: list[tuple[int, str | None, float, float]], table: Any, eff: dict[str, float]
) -> float:
    """Seconds of a recorded step (``DryRun.trace``) on `table`'s device at efficiencies `eff`:
    the clock run again without the step (how a calibration tries efficiencies quickly)."""
    from .roofline import kernel_seconds

    host = device = 0.0
    op_s, mode_s = eff["host_op_us"] * 1e-6, eff["host_mode_us"] * 1e-6
    for n, kind, flops, nbytes in trace:
        host += op_s + n * mode_s
        if kind is None:
            continue
        seconds = flops if kind == "codec" else kernel_seconds(table, eff, kind, flops, nbytes)
        device = max(device, host) + seconds
    return max(host, device)
