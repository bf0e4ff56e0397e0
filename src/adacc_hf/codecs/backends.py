"""Codec backends: one contract, several implementations, measured per device.

A codec is its contract: the payload layout and the arithmetic its torch reference fixes
(``Codec._encode`` / ``Codec._decode``, conventions in :mod:`.base`). A *backend* is a way of
running it; every backend of a codec gives the reference's payload and decoded tensor bit for
bit (tests hold each one to it), so a payload decodes on any of them:

* ``torch``: the reference, eager (any device).
* ``inductor``: the same reference traced once per input shape (``make_fx``) and compiled by
  TorchInductor (C++ on a CPU, Triton on a GPU): one source of truth, no hand tuning. Compiled
  graphs are called directly, not through dynamo, so they also run inside the runtime's dispatch
  modes (``torch.compile`` refuses to run there); the first call at a shape compiles (seconds).
* ``triton``: the hand-written, self-tuning kernels of ``adacc_kernels`` (CUDA; a CPU only
  under ``TRITON_INTERPRET=1``), where the codec has them (:func:`.dispatch.has_kernel`).
* library backends (``bitsandbytes``, ``torchao``): a well-kept library's own kernels for the
  codecs whose format is that library's (:func:`register_backend`).

``Codec.backend`` pins one (a policy names it: ``schema.Action.backend``, chosen by the profiler
as the fastest measured on the device). ``None`` follows the kernel mode (:mod:`.dispatch`):
the Triton kernels on supported GPUs, else the reference. A pinned backend that cannot run where
the tensor lives falls back to that rule, with one log line per codec, backend and device; an
explicit kernel mode (``ADACC_KERNELS=torch`` / ``triton``) overrides every pin.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import dispatch

logger = logging.getLogger("adacc_hf")

# Codecs and payloads are passed in by ``codecs.base`` (which imports this module): duck-typed.
Codec = Encoded = Any

__all__ = [
    "BACKENDS",
    "LibraryBackend",
    "backends_of",
    "clear_compiled",
    "compiled_counts",
    "decode",
    "encode",
    "priced",
    "register_backend",
    "resolve",
    "unavailable",
]

#: Every backend name, in the order the profiler lists them.
BACKENDS = ("torch", "inductor", "triton", "bitsandbytes", "torchao")


@dataclass(frozen=True)
class LibraryBackend:
    """A library's kernels for one codec: ``encode(codec, x) -> (tensors, meta)`` on a validated
    row-major ``x``, ``decode(codec, enc) -> tensor`` of ``enc.stored_shape``, and ``check(device)``:
    None where it can run, else why not."""

    encode: Callable[[Any, torch.Tensor], tuple[dict[str, torch.Tensor], dict[str, Any]]]
    decode: Callable[[Any, Any], torch.Tensor]
    check: Callable[[torch.device], str | None]


_LIBRARY: dict[tuple[str, str], LibraryBackend] = {}


def register_backend(codec_name: str, backend: str, impl: LibraryBackend) -> None:
    """Make ``backend`` (a name in :data:`BACKENDS`) run codec ``codec_name``."""
    if backend not in BACKENDS or backend in ("torch", "inductor", "triton"):
        raise ValueError(f"library backend must be one of {BACKENDS[3:]}, got {backend!r}")
    _LIBRARY[(codec_name, backend)] = impl


def backends_of(codec_name: str) -> tuple[str, ...]:
    """The backends that implement codec ``codec_name`` (wherever they can run)."""
    names = ["torch", "inductor"]
    if dispatch.has_kernel(codec_name):
        names.append("triton")
    names += [b for b in BACKENDS[3:] if (codec_name, b) in _LIBRARY]
    return tuple(names)


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def unavailable(codec_name: str, backend: str, device: torch.device) -> str | None:
    """None where ``backend`` can run codec ``codec_name`` on ``device``, else why not (no data is
    read; decided by what is installed and the device's kind)."""
    device = torch.device(device)
    if backend not in backends_of(codec_name):
        return f"codec {codec_name!r} has no {backend!r} backend"
    if backend == "torch":
        return None
    if backend == "inductor":
        if device.type not in ("cpu", "cuda"):
            return f"inductor compiles for CPU and CUDA tensors, not {device.type}"
        if device.type == "cuda" and not _module("triton"):
            return "inductor needs triton on a GPU"
        return None
    if backend == "triton":
        return dispatch.kernel_unavailable(device)
    return _LIBRARY[(codec_name, backend)].check(device)


_warned: set[tuple[str, str, str]] = set()


def _rule(name: str, device: torch.device) -> str:
    """The backend the kernel mode picks: the kernels where they run, else the reference."""
    if dispatch.has_kernel(name) and dispatch.use_kernel(device):
        return "triton"
    return "torch"


def resolve(codec: Codec, device: torch.device) -> str:
    """The backend that runs `codec` on `device` (see the module docstring)."""
    pinned = codec.backend
    if pinned is None or (pinned == "torch" and dispatch.kernel_mode() == "auto"):
        return pinned or _rule(codec.name, device)
    return _resolved(codec.name, pinned, device, dispatch.kernel_mode(), dispatch.generation())


@functools.lru_cache(maxsize=256)
def _resolved(name: str, pinned: str, device: torch.device, mode: str, generation: int) -> str:
    """A pinned backend's resolution (cached: the hot path reads no environment)."""
    if mode != "auto":
        return _rule(name, device)
    why = unavailable(name, pinned, device)
    if why is None:
        return pinned
    fallback = _rule(name, device)
    key = (name, pinned, str(device))
    if key not in _warned:
        _warned.add(key)
        logger.info(
            "adacc: codec %s's %s backend cannot run on %s (%s); using %s",
            name,
            pinned,
            device,
            why,
            fallback,
        )
    return fallback


# -- inductor: the reference compiled per shape ---------------------------------------------


def _flatten(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> list[torch.Tensor]:
    return [*tensors.values(), *(v for v in meta.values() if torch.is_tensor(v))]


@dataclass
class _Compiled:
    fn: Callable[..., Any]
    tensor_keys: list[str]
    meta_keys: list[str]
    meta_rest: dict[str, Any]


_COMPILED: dict[tuple, _Compiled | None] = {}


def clear_compiled() -> None:
    """Forget the compiled graphs (tests; a process that changes inductor's settings)."""
    _COMPILED.clear()


def compiled_counts() -> tuple[int, int]:
    """(graphs compiled and checked, graphs refused: not compiled or unlike the reference)."""
    ok = sum(c is not None for c in _COMPILED.values())
    return ok, len(_COMPILED) - ok


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _compile(fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor]) -> Callable:
    """``fn`` (tensors in, a list of tensors out) traced on ``inputs`` and compiled by inductor,
    outside every dispatch mode the caller runs under."""
    from torch._inductor import compile as inductor_compile
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        gm = make_fx(fn, tracing_mode="real")(*inputs)
        return inductor_compile(gm, list(inputs))


def _params_key(codec: Codec) -> str:
    return repr(sorted(codec.params().items()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bits (NaNs included) in the same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_floating_point():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def _checked(codec: Codec, what: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    """Whether a compiled graph's first results are the reference's bit for bit (compilers have
    bugs: torch 2.13's inductor on a CPU mis-indexes a slice of a reshaped product, e.g. the last
    block of FP8 codes of 576 channels); logged where not."""
    if len(got) == len(ref) and all(same_bits(a, b) for a, b in zip(got, ref, strict=True)):
        return True
    logger.warning(
        "adacc: inductor's compiled %s of %s differs from the reference; using torch for it",
        what,
        codec,
    )
    return False


def _compiled_encode(codec: Codec, x: torch.Tensor) -> _Compiled | None:
    """The compiled encode of `codec` at `x`'s shape, checked on `x` against the reference
    (None: the reference runs)."""
    key = ("encode", codec.name, _params_key(codec), _signature(x))
    if key in _COMPILED:
        return _COMPILED[key]
    got: _Compiled | None = None
    try:
        tensors, meta = codec._encode(x)

        def run(x: torch.Tensor) -> list[torch.Tensor]:
            t, m = codec._encode(x)
            return _flatten(t, m)

        fn = _compile(run, [x])
        if _checked(codec, "encode", list(fn(x)), _flatten(tensors, meta)):
            rest = {k: v for k, v in meta.items() if not torch.is_tensor(v)}
            mkeys = [k for k, v in meta.items() if torch.is_tensor(v)]
            got = _Compiled(fn, list(tensors), mkeys, rest)
    except Exception as err:  # a graph inductor cannot compile runs the reference
        logger.info("adacc: inductor could not compile %s's encode (%s); using torch", codec, err)
    _COMPILED[key] = got
    return got


def _compiled_decode(codec: Codec, enc: Encoded) -> _Compiled | None:
    """The compiled decode of `codec` for payloads like `enc`, checked on `enc` against the
    reference (None: the reference runs)."""
    tensors = list(enc.tensors.values())
    key = (
        "decode",
        codec.name,
        _params_key(codec),
        tuple(enc.tensors),
        tuple(_signature(t) for t in tensors),
        tuple(enc.shape),
        enc.dtype,
        enc.order,
    )
    if key in _COMPILED:
        return _COMPILED[key]
    got: _Compiled | None = None
    names = list(enc.tensors)
    try:

        def run(*ts: torch.Tensor) -> list[torch.Tensor]:
            e = type(enc)(enc.codec, enc.shape, enc.dtype, dict(zip(names, ts, strict=True)))
            e.meta, e.order = enc.meta, enc.order
            return [codec._decode(e).contiguous().reshape(enc.stored_shape)]

        want = run(*tensors)  # first: constants the reference caches are then traced as such
        fn = _compile(run, tensors)
        if _checked(codec, "decode", list(fn(*tensors)), want):
            got = _Compiled(fn, names, [], {})
    except Exception as err:
        logger.info("adacc: inductor could not compile %s's decode (%s); using torch", codec, err)
    _COMPILED[key] = got
    return got


def _encode_inductor(codec: Codec, x: torch.Tensor) -> tuple[dict, dict]:
    c = _compiled_encode(codec, x)
    if c is None:
        return codec._encode(x)
    out = c.fn(x)
    n = len(c.tensor_keys)
    tensors = dict(zip(c.tensor_keys, out[:n], strict=True))
    meta = {**c.meta_rest, **dict(zip(c.meta_keys, out[n:], strict=True))}
    return tensors, meta


def _decode_inductor(codec: Codec, enc: Encoded) -> torch.Tensor:
    c = _compiled_decode(codec, enc)
    if c is None:
        return codec._decode(enc).contiguous().reshape(enc.stored_shape)
    return c.fn(*enc.tensors.values())[0]


# -- the calls codecs make -----------------------------------------------------------------

#: While a modelled device prices the work (`devices.dryrun`): a context manager factory
#: ``pricer(codec, what, shape, dtype)`` around each encode / decode, which runs the reference.
_pricer: list[Callable[..., Any]] = []


@contextlib.contextmanager
def priced(pricer: Callable[..., Any]) -> Iterator[None]:
    """Inside, codec calls run their reference under ``pricer(codec, "encode" | "decode", shape,
    dtype)``: a modelled device charges a codec call as a whole, from its table."""
    _pricer.append(pricer)
    try:
        yield
    finally:
        _pricer.pop()


def encode(codec: Codec, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Payload (tensors, meta) of a validated, row-major ``x`` on the backend `resolve` picks."""
    if _pricer:
        with _pricer[-1](codec, "encode", x.shape, x.dtype):
            return codec._encode(x)
    backend = resolve(codec, x.device)
    if backend == "torch":
        return codec._encode(x)
    if backend == "triton":
        return dispatch.encode(codec, x)
    if backend == "inductor":
        return _encode_inductor(codec, x)
    return _LIBRARY[(codec.name, backend)].encode(codec, x)


def decode(codec: Codec, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    """The decoded tensor of ``enc.stored_shape`` (row-major; written into ``out`` when given)."""
    if _pricer:
        with _pricer[-1](codec, "decode", enc.stored_shape, enc.dtype):
            y = codec._decode(enc).contiguous().reshape(enc.stored_shape)
        return y if out is None else out.copy_(y)
    backend = resolve(codec, enc.device)
    if backend == "triton":
        return dispatch.decode(codec, enc, out)
    if backend == "torch":
        y = codec._decode(enc).contiguous().reshape(enc.stored_shape)
    elif backend == "inductor":
        y = _decode_inductor(codec, enc)
    else:
        y = _LIBRARY[(codec.name, backend)].decode(codec, enc)
        y = y.contiguous().reshape(enc.stored_shape)
    return y if out is None else out.copy_(y)
