"""Kernel or reference: which implementation encodes / decodes a tensor.

Every codec's ``encode`` / ``decode`` first asks :func:`use_kernel`; when it says yes the call
goes to the Triton kernels (package ``kernels``, registered as ``torch.ops.adacc.*`` custom ops),
otherwise the codec's torch reference runs. Both produce the same payload layout (bit for bit
where documented in ``kernels``), so payloads decode on either path.

Mode (:func:`kernel_mode`): :func:`set_kernel_mode` / :func:`kernel_mode_override` if set, else the
``ADACC_KERNELS`` environment variable (read once; :func:`refresh_kernel_mode` re-reads it after
a change mid-process), else ``"auto"``. The decision per device is cached until the mode changes,
so a codec call reads no environment and imports nothing:

* ``"auto"``: kernels for CUDA tensors (compute capability >= 8.0) when triton imports; the
  reference otherwise.
* ``"triton"``: always kernels. CUDA tensors need triton; CPU tensors need Triton's interpreter
  (``TRITON_INTERPRET=1`` set before the first kernel use) -- anything else raises
  :class:`KernelError` saying what to change.
* ``"torch"``: always the reference.

What runs where on the kernel path: quantisation, packing, statistics (absmax / min-max /
column sums), the ``int4_outlier`` channel selection (z-scores of the column sums), outlier
gather and scatter, bit packing and FP8 conversion run in Triton; torch only allocates
outputs. Nothing waits for the device: payload sizes never depend on the data. Inputs
arrive in memory order (``base.memory_order``), so reshaping to [rows, channels] never copies.
The one result that can differ from the reference: the selection sums columns in another order
than ``torch.sum``, so a channel within float32 rounding of the z-score threshold may be
classified differently (given the same channels, payloads are bit-identical).

Eager calls go straight to the launch functions; under ``torch.compile`` (or for tensor
subclasses such as fake tensors) the ``torch.ops.adacc.*`` custom ops are called instead.
Importing this module imports neither ``kernels`` nor triton; both load on first kernel use.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import AdaccError

# Codecs and payloads are passed in by ``codecs.base`` (which imports this module): here they
# are duck-typed, so this module imports nothing from it.
Codec = Encoded = Any

__all__ = [
    "ENV_VAR",
    "MODES",
    "KernelError",
    "decode",
    "encode",
    "generation",
    "has_kernel",
    "kernel_mode",
    "kernel_mode_override",
    "kernel_unavailable",
    "kernels_available",
    "refresh_kernel_mode",
    "set_kernel_mode",
    "use_kernel",
]

ENV_VAR = "ADACC_KERNELS"
MODES = ("auto", "triton", "torch")
_override: str | None = None
# Resolved once and kept until the mode changes (set_kernel_mode, kernel_mode_override,
# refresh_kernel_mode): the hot path reads no environment and imports nothing per call.
_env_mode: str | None = None
_decisions: dict[torch.device, bool] = {}
# Bumped whenever the mode may have changed: what other modules cache per mode keys on it.
_generation = 0


class KernelError(AdaccError):
    """Kernels were forced (``"triton"`` mode) where they cannot run, or a mode is unknown."""


def _check_mode(mode: str, where: str) -> str:
    if mode not in MODES:
        raise KernelError(f"{where}: kernel mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def generation() -> int:
    """A number that changes whenever the kernel mode may have changed (caches key on it)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1
    _decisions.clear()


def kernel_mode() -> str:
    """The active mode: the programmatic override, else ``$ADACC_KERNELS`` (read on first use
    and after :func:`refresh_kernel_mode`), else ``"auto"``."""
    global _env_mode
    if _override is not None:
        return _override
    if _env_mode is None:
        env = os.environ.get(ENV_VAR, "").strip().lower()
        _env_mode = _check_mode(env, f"${ENV_VAR}") if env else "auto"
    return _env_mode


def refresh_kernel_mode() -> None:
    """Forget the resolved mode: the next call reads ``$ADACC_KERNELS`` (and Triton's own
    ``TRITON_INTERPRET``) again. Needed only after changing those variables mid-process."""
    global _env_mode
    _env_mode = None
    _changed()


def set_kernel_mode(mode: str | None) -> None:
    """Force ``"auto"``, ``"triton"`` or ``"torch"`` for this process; ``None`` clears it."""
    global _override
    _override = None if mode is None else _check_mode(mode, "set_kernel_mode")
    _changed()


@contextlib.contextmanager
def kernel_mode_override(mode: str | None) -> Iterator[None]:
    """``with kernel_mode_override("torch"): ...`` -- the previous setting is restored."""
    global _override
    previous = _override
    set_kernel_mode(mode)
    try:
        yield
    finally:
        _override = previous
        _changed()


@functools.cache
def kernels_available() -> bool:
    """Whether the ``kernels`` package and triton import (checked once; never initialises CUDA)."""
    try:
        from adacc_kernels._triton import triton_available
    except ImportError:
        return False
    return triton_available()


@functools.cache
def _supported_gpu(device: torch.device) -> bool:
    """Ampere or newer: the kernels are compiled and checked for sm_80 / sm_90. Older GPUs run
    the reference in "auto" mode (force "triton" to try the kernels there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def kernel_unavailable(device: torch.device) -> str | None:
    """None where the Triton kernels can run on ``device`` (a CUDA GPU of sm_80 or newer, or a CPU
    under Triton's interpreter), else why not."""
    if device.type == "cuda":
        if not kernels_available():
            return "triton is not installed"
        return None if _supported_gpu(device) else "the kernels need a GPU of sm_80 or newer"
    try:
        from adacc_kernels._triton import KernelUnavailableError, check_launchable
    except ImportError as err:
        return f"the kernels package is missing: {err}"
    try:
        check_launchable(device)
    except KernelUnavailableError as err:
        return str(err)
    return None


def _decide(mode: str, device: torch.device) -> bool:
    """Whether ``mode`` runs kernels on ``device`` (raises when "triton" cannot)."""
    if mode == "torch":
        return False
    if mode == "auto":
        return device.type == "cuda" and kernels_available() and _supported_gpu(device)
    try:
        from adacc_kernels._triton import KernelUnavailableError, check_launchable
    except ImportError as err:
        raise KernelError(
            f"kernel mode 'triton' but the kernels package is missing: {err}"
        ) from err
    try:
        check_launchable(device)
    except KernelUnavailableError as err:
        raise KernelError(f"kernel mode 'triton': {err}") from err
    return True


def use_kernel(x: torch.Tensor | torch.device) -> bool:
    """Whether to run the Triton kernel for a tensor (or payload) on this device (decided once
    per device until the mode changes)."""
    device = x if isinstance(x, torch.device) else x.device
    use = _decisions.get(device)
    if use is None:
        use = _decisions[device] = _decide(kernel_mode(), device)
    return use


# -- codec glue: payloads <-> custom ops ---------------------------------------------------


@functools.cache
def _direct() -> dict[str, Callable[..., Any]]:
    """The plain launch functions by op name (importing ``adacc_kernels.ops`` once registers
    ``torch.ops.adacc.*``)."""
    from adacc_kernels import ops

    return ops.DIRECT


def _call(op: str, like: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Run kernel op ``op``: through ``torch.ops.adacc`` when tracing / compiling (or for tensor
    subclasses such as fake tensors), else the plain launch function (no dispatcher overhead;
    only it takes ``out=``, the op's result is copied into ``out`` instead)."""
    direct = _direct()
    if type(like) is torch.Tensor and not torch.compiler.is_compiling():
        return direct[op](*args, **kwargs)
    res = getattr(torch.ops.adacc, op)(*args)
    out = kwargs.get("out")
    return res if out is None else out.copy_(res.reshape(out.shape))


def _rows_channels(shape: Any) -> tuple[int, int]:
    channels = int(shape[-1]) if len(shape) > 0 else 1
    return math.prod(shape) // channels, channels


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (row-major) as [rows, channels]: a view, never a copy."""
    return x.reshape(_rows_channels(x.shape))


def _out2d(out: torch.Tensor | None) -> torch.Tensor | None:
    return None if out is None else out.view(_rows_channels(out.shape))


def _enc_int4_naive(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    q, scale = _call("int4_naive_encode", x, _rows(x), codec.group_size)
    return {"q": q, "scale": scale}, {}


def _dec_int4_naive(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    t = enc.tensors
    rows, channels = _rows_channels(enc.stored_shape)
    args = (t["q"], t["scale"], rows, channels, codec.group_size, enc.dtype)
    return _call("int4_naive_decode", t["q"], *args, out=_out2d(out))


def _enc_int4_outlier(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    xr = _rows(x)
    capacity = codec.capacity(xr.shape[1])
    args = (xr, codec.group_size, codec.zscore_threshold, capacity)
    q, scale, values, idx, count, slot = _call("int4_outlier_encode", x, *args)
    tensors = {
        "q": q,
        "scale": scale,
        "outlier_values": values,
        "outlier_idx": idx,
        "outlier_slot": slot,
    }
    return tensors, {"outlier_count": count}


def _dec_int4_outlier(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    t = enc.tensors
    rows, channels = _rows_channels(enc.stored_shape)
    args = (t["q"], t["scale"], t["outlier_values"], t["outlier_slot"], rows, channels)
    return _call("int4_outlier_decode", t["q"], *args, codec.group_size, enc.dtype, out=_out2d(out))


def _enc_int4_channel(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    q, scale = _call("int4_channel_encode", x, _rows(x))
    return {"q": q, "scale": scale}, {}


def _dec_int4_channel(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    rows, channels = _rows_channels(enc.stored_shape)
    t = enc.tensors
    args = (t["q"], t["scale"], rows, channels, enc.dtype)
    return _call("int4_channel_decode", t["q"], *args, out=_out2d(out))


def _enc_int4_asym(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    q, scale, offset = _call("int4_asym_encode", x, _rows(x))
    return {"q": q, "scale": scale, "offset": offset}, {}


def _dec_int4_asym(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    rows, channels = _rows_channels(enc.stored_shape)
    t = enc.tensors
    args = (t["q"], t["scale"], t["offset"], rows, channels, enc.dtype)
    return _call("int4_asym_decode", t["q"], *args, out=_out2d(out))


def _enc_bitpack(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    bits, scale, _flags = _call("bitpack_encode", x, x.reshape(-1))
    if x.dtype == torch.bool:
        return {"bits": bits}, {}
    return {"bits": bits, "scale": scale}, {}  # scale is NaN for a non-mask (see the codec)


def _dec_bitpack(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    bits = enc.tensors["bits"]
    scale = enc.tensors.get("scale", bits)  # bool masks have no scale; any tensor will do
    flat = None if out is None else out.view(-1)
    return _call("bitpack_decode", bits, bits, scale, enc.shape.numel(), enc.dtype, out=flat)


def _enc_fp8(codec: Any, x: torch.Tensor) -> tuple[dict, dict]:
    q, scale = _call("fp8_e4m3_encode", x, _rows(x))
    return {"q": q, "scale": scale}, {}


def _dec_fp8(codec: Any, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    t = enc.tensors
    return _call("fp8_e4m3_decode", t["q"], t["q"], t["scale"], enc.dtype, out=_out2d(out))


_GLUE: dict[str, tuple[Callable[..., tuple[dict, dict]], Callable[..., torch.Tensor]]] = {
    "int4_naive": (_enc_int4_naive, _dec_int4_naive),
    "int4_outlier": (_enc_int4_outlier, _dec_int4_outlier),
    "int4_channel": (_enc_int4_channel, _dec_int4_channel),
    "int4_asym": (_enc_int4_asym, _dec_int4_asym),
    "bitpack": (_enc_bitpack, _dec_bitpack),
    "fp8_e4m3": (_enc_fp8, _dec_fp8),
}


def has_kernel(codec_name: str) -> bool:
    return codec_name in _GLUE


def encode(codec: Codec, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Kernel-path payload (tensors, meta) of a validated, row-major ``x``."""
    return _GLUE[codec.name][0](codec, x)


def decode(codec: Codec, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel-path decode: a tensor of ``enc.stored_shape`` / ``enc.dtype`` (written into
    ``out``, a row-major tensor of that shape, when given)."""
    y = _GLUE[codec.name][1](codec, enc, out)
    return out if out is not None else y.reshape(enc.stored_shape)
