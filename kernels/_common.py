"""Shared Triton helpers (device functions) and host utilities of the codec kernels.

Arithmetic follows ``adacc_hf.codecs.base`` bit for bit: float32 throughout, IEEE divisions
(``tl.math.div_rn``, never the approximate ``/``), round half to even, no FMA contraction (every
launch passes ``enable_fp_fusion=False``), one final rounding cast to the output dtype.

Two portability details:

* Non-finite inputs follow ``adacc_hf.codecs.base``: statistics over finite elements, flagged
  segments (sign bit of the scale, set with :func:`with_sign`) and marker codes.
* Rounding uses ``y + 1.5 * 2**23 - 1.5 * 2**23`` (exact round-half-even for ``|y| < 2**22``;
  every quantiser here divides by a scale derived from the block's own maximum, so
  ``|y| <= 16``). ``libdevice.rint`` would do on GPUs but is missing in the interpreter.
* float32 -> bfloat16 is rounded to nearest even by hand (:func:`f32_to_bf16_bits`) and stored
  through an int16 view: Triton's interpreter truncates that cast while GPUs round, so the
  manual rounding makes both bit-identical to ``torch.Tensor.to(torch.bfloat16)``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .layout import group_layout  # noqa: F401 (re-exported for the codec modules)

# Whether the kernels of this process were defined for Triton's CPU interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Elements per program for the streaming kernels (registers, not shared memory).
TILE = 4096
# Widest segment (group / row) a program holds in registers; wider segments are processed in
# chunks of this width with a second (cache-hot) read. Tests lower it to exercise that path.
MAX_SEGMENT_WIDTH = 4096
# Launch options shared by every kernel: no a*b+c -> fma contraction (decode is q*scale+offset).
NO_FMA = {"enable_fp_fusion": False}


# -- device helpers ----------------------------------------------------------------------
# Reductions call the builtin tl.reduce / tl.associative_scan with the standard library's own
# combine functions instead of tl.sum / tl.max / tl.cumsum: those wrappers are @triton.jit
# functions, created in compiled mode if ``triton.language`` was imported before
# TRITON_INTERPRET=1 was set (transformers imports torch._dynamo, which imports triton), and the
# interpreter cannot call them. It recognises the combine functions themselves and reduces with
# numpy, so only this package's modules need to be imported after the variable is set.


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


_SUM = getattr(tl.standard, "_sum_combine", _add_combine)
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_MIN = getattr(tl.standard, "_elementwise_min", _min_combine)


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM)


@triton.jit
def rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX)


@triton.jit
def rmin(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MIN)


@triton.jit
def cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, _SUM)


@triton.jit
def round_half_even(y):
    """``torch.round`` for float32 ``|y| < 2**22`` (adding 1.5 * 2**23 drops the fraction)."""
    return y + 12582912.0 - 12582912.0


@triton.jit
def quantize_sym(v, scale):
    """int32 codes ``clamp(round_half_even(v / scale), -8, 7)``; 0 where ``scale == 0``."""
    zero = scale == 0.0
    q = round_half_even(tl.math.div_rn(v, tl.where(zero, 1.0, scale)))
    q = tl.where(zero, 0.0, q)
    return tl.minimum(tl.maximum(q, -8.0), 7.0).to(tl.int32)


@triton.jit
def is_finite(x):
    """float32 ``x`` is neither inf nor NaN (``NaN < inf`` is false)."""
    return tl.abs(x) < float("inf")


@triton.jit
def int4_markers(x):
    """int32 marker codes of non-finite ``x``: -inf -> -8, +inf -> 7, NaN -> -7."""
    return tl.where(x != x, -7, tl.where(x > 0.0, 7, -8))


@triton.jit
def quantize_robust(x, scale, fin):
    """:func:`quantize_sym` of the finite elements, marker codes for the others."""
    return tl.where(fin, quantize_sym(tl.where(fin, x, 0.0), scale), int4_markers(x))


FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # a flagged segment's smallest scale


@triton.jit
def flagged_scale(scale, flag):
    """A flagged segment's scale magnitude is at least FLT_MIN (markers times it stay inf)."""
    return tl.where(flag & (scale == 0.0), FLT_MIN, scale)


@triton.jit
def with_sign(v, flag):
    """float32 ``v`` with the sign bit set where ``flag`` (``-0.0`` for 0; ``-v`` would give
    ``0 - v`` = ``+0.0``)."""
    u = v.to(tl.uint32, bitcast=True) | (flag.to(tl.uint32) << 31)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def sign_set(v):
    """Whether float32 ``v`` has its sign bit set (a flagged scale, ``-0.0`` included)."""
    return (v.to(tl.uint32, bitcast=True) >> 31) != 0


@triton.jit
def int4_unmark(y, nib, flagged):
    """float32 values ``y`` of nibbles ``nib`` with the markers of flagged segments restored."""
    y = tl.where(flagged & (nib == 0), -float("inf"), y)
    y = tl.where(flagged & (nib == 15), float("inf"), y)
    return tl.where(flagged & (nib == 1), float("nan"), y)


@triton.jit
def pack_nibbles(q_even, q_odd):
    """Codes of elements 2i (low nibble) and 2i+1 (high nibble) as ``q + 8`` -> uint8."""
    return ((q_even + 8) | ((q_odd + 8) << 4)).to(tl.uint8)


@triton.jit
def f32_to_bf16_bits(y):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even; inf stays inf and every
    NaN becomes torch's quiet NaN 0x7FC0 (rounding a NaN's bits would carry out of the payload:
    a GPU's own NaN, 0x7FFFFFFF, became -0.0)."""
    u = y.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(y != y, 0x7FC0, r).to(tl.int16)


@triton.jit
def cast_out(y, out_ptr, OUT_BF16: tl.constexpr):
    """float32 ``y`` as the element type of ``out_ptr`` (bf16 outputs are int16 views)."""
    if OUT_BF16:
        return f32_to_bf16_bits(y)
    else:
        return y.to(out_ptr.dtype.element_ty)


# -- host helpers ------------------------------------------------------------------------

_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(t.device)`` for a CUDA tensor (Triton launches on the *current*
    device: a model split over GPUs needs the tensor's own); one shared no-op context for any
    other tensor (nothing is called, nothing allocated)."""
    return torch.cuda.device(t.device) if t.is_cuda else _NO_GUARD


def launch(
    kernel: Any,
    grid: Sequence[int] | Callable[[dict[str, Any]], Sequence[int]],
    *args: Any,
    **kwargs: Any,
) -> None:
    """``kernel[grid](*args, **kwargs)`` on the device of ``args[0]``, without FMA contraction.
    Every kernel of this package is launched through here; ``kernel`` is an autotuner from
    :meth:`Tuned.tuner` (or any Triton kernel), ``grid`` a tuple or a function of the launch's
    arguments (``META``), as Triton takes it."""
    with device_guard(args[0]):
        kernel[grid if callable(grid) else tuple(grid)](*args, **kwargs, **NO_FMA)


def pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4


def store_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel stores float results into (bf16 through its int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view (raw bit patterns) of a float or bool tensor."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def check_rows_input(x: torch.Tensor) -> tuple[int, int]:
    """(rows, channels) of a 2-D float input (any strides: kernels read through them)."""
    if x.dim() != 2:
        raise ValueError(f"kernels expect a [rows, channels] tensor, got {x.shape}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"kernels support float32/float16/bfloat16, got {x.dtype}")
    return x.shape[0], x.shape[1]


# -- autotuning --------------------------------------------------------------------------
# Every launched kernel is a :class:`Tuned`: a ``@triton.jit`` function plus the function that
# lists its configs for a launch *plan* (the shape buckets and settings its tile choice depends
# on). Each plan gets its own ``triton.autotune`` object; under the interpreter its config list
# is exactly today's heuristic choice, on a GPU the candidates below (module doc of
# :mod:`adacc_kernels`: what is tuned, what is keyed, the invariance rule).

# Elements per program of the GPU candidates: small tiles with few warps up to big ones.
TILE_SIZES = (512, 1024, 2048, 4096, 8192)
# Software-pipelining depths tried for kernels that loop (kernels without loops keep Triton's
# default, 3, which is also what every launch compiled with before autotuning); the short list
# where the tiles already give many candidates.
LOOP_STAGES = (1, 2, 3)
FEW_STAGES = (1, 3)
DEFAULT_STAGES = 3


def warps_for(elems: int) -> tuple[int, ...]:
    """Warp counts tried for a tile of ``elems`` elements (about 4 to 32 per thread)."""
    if elems <= 256:
        return (1, 2)
    if elems <= 1024:
        return (2, 4)
    if elems <= 4096:
        return (4, 8)
    return (8, 16)


def config(num_warps: int, num_stages: int = DEFAULT_STAGES, **tiles: int) -> triton.Config:
    """A ``triton.Config`` of tile constexprs (``BLOCK_R=...``) and launch options."""
    return triton.Config(tiles, num_warps=num_warps, num_stages=num_stages)


def candidates(
    tiles: Iterable[dict[str, int]],
    elems: Callable[[triton.Config], int],
    stages: Sequence[int] = (DEFAULT_STAGES,),
) -> list[triton.Config]:
    """Each tile with the warp counts that suit its size (:func:`warps_for`) and each of
    ``stages``."""
    out = []
    for tile in tiles:
        n = elems(config(1, **tile))
        out += [config(w, s, **tile) for w in warps_for(n) for s in stages]
    return out


def configs(
    interpreted_choice: triton.Config,
    gpu_candidates: Iterable[triton.Config],
    *,
    interpreted: bool = INTERPRETED,
) -> list[triton.Config]:
    """The config list of one launch plan. Interpreted: exactly ``interpreted_choice`` (the
    heuristic the kernels used before autotuning: tests stay as fast and give what they gave).
    GPU: that choice first, then the candidates (duplicates dropped), so tuning never picks
    worse than the heuristic."""
    if interpreted:
        return [interpreted_choice]
    return list(dict.fromkeys([interpreted_choice, *gpu_candidates]))


def tile_elems(c: triton.Config) -> int:
    """Elements one program covers when a config's constexprs are all tile extents."""
    return math.prod(c.kwargs.values())


def size_class(*dims: int) -> int:
    """The ``tune_key`` argument: the power-of-two bucket of each dimension, 6 bits each (shapes
    that differ within a bucket share one tuning)."""
    key = 0
    for i, d in enumerate(dims):
        key |= min((max(int(d), 1) - 1).bit_length(), 63) << (6 * i)
    return key


def chosen(tuner: Any) -> triton.Config:
    """The config ``tuner`` launched with last (its first one before it ran, for launch
    recorders that never run it)."""
    return getattr(tuner, "best_config", None) or tuner.configs[0]


class Tuned:
    """A ``@triton.jit`` kernel launched through ``triton.autotune``.

    ``space(*plan, interpreted=...)`` lists the configs of a launch plan (built with
    :func:`configs`; pruned to what applies to the plan), ``elems(config)`` counts the elements
    one program covers, ``key`` names the kernel arguments besides ``tune_key`` (always keyed)
    whose values select a tuning, ``reset_to_zero`` / ``restore_value`` the buffers the tuner's
    repeated runs must not leave changed (as in ``triton.autotune``).
    """

    def __init__(
        self,
        fn: Any,
        space: Callable[..., list[triton.Config]],
        *,
        elems: Callable[[triton.Config], int],
        key: Sequence[str] = (),
        reset_to_zero: Sequence[str] = (),
        restore_value: Sequence[str] = (),
    ) -> None:
        self.fn = fn
        self.space = space
        self.elems = elems
        self.key = ["tune_key", *key]
        self.reset_to_zero = list(reset_to_zero)
        self.restore_value = list(restore_value)
        self._tuners: dict[tuple[Any, ...], Any] = {}
        ALL_TUNED.append(self)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def tuner(self, *plan: Any) -> Any:
        """The autotuner of ``plan`` (built on first use, then cached)."""
        tuner = self._tuners.get(plan)
        if tuner is None:
            tuner = self.autotuner(self.space(*plan, interpreted=INTERPRETED))
            self._tuners[plan] = tuner
        return tuner

    def autotuner(self, configs: list[triton.Config]) -> Any:
        """A new ``triton.autotune`` object over ``configs`` (tunings cached on disk too)."""
        return triton.autotune(
            configs,
            key=self.key,
            reset_to_zero=self.reset_to_zero or None,
            restore_value=self.restore_value or None,
            cache_results=True,
        )(self.fn)


# Every Tuned kernel, in definition order (tests walk them).
ALL_TUNED: list[Tuned] = []
