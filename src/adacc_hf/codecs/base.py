"""Codec base class, payload container, registry, and how an encoding is judged.

Conventions shared by every codec (the Triton kernels must follow them bit for bit):

* "channels" are the LAST dimension of the input, "rows" are all other dims flattened
  (a 0-dim tensor is one row of one channel). Row-major order throughout.
* Memory order: a dense input whose leading dims are permuted in memory (e.g. the output of
  ``clone()`` of a transposed tensor) is encoded in its memory order, without a copy: rows are
  taken in the order they lie in memory (``Encoded.order`` records the permutation) and decode
  returns a view with the input's strides. Per-row and per-channel statistics do not depend on
  the row order, so decoded values are the same either way (the outlier *selection* sums columns
  in another order, see ``int4_outlier``). Inputs whose last dim is not innermost are copied.
* Arithmetic is float32: the input is converted with ``x.to(torch.float32)`` (exact for
  fp16/bf16/fp32), divisions are IEEE round-to-nearest float32 divisions (use ``div_rn`` in
  Triton, not the approximate ``/``), ``round_half_even`` is ``torch.round``.
* Decode computes in float32 and casts once to the original dtype (round to nearest even).
  Multiply and add are separately rounded float32 ops (no FMA contraction).
* Non-finite inputs are encoded robustly, at the same size and without a host sync: every
  *segment* (the elements that share one scale) takes its statistics over its finite elements
  only. A segment holding an inf or NaN is *flagged*: its float32 scale is stored with the sign
  bit set, its finite elements are quantised onto codes [-6, 6] (INT4: ``absmax / 6``, or
  ``(max - min) / 12`` for the asymmetric codec; FP8: ``absmax / 224``; a zero scale becomes
  ``FLT_MIN``, so markers times the scale stay infinite) and the freed codes mark the non-finite
  ones: INT4 ``-8`` = -inf, ``7`` = +inf, ``-7`` = NaN;
  FP8 ``-448`` = -inf, ``+448`` = +inf, NaN = NaN. Decoding restores them exactly (e.g. the
  ``-inf`` of a masked attention score). Finite inputs give exactly the payloads they always did.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import AdaccError
from . import backends

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class CodecError(AdaccError, ValueError):
    """Bad codec name, bad codec parameters, or an input the codec cannot encode."""


@dataclass
class Encoded:
    """A compressed tensor: payload tensors plus small python metadata.

    The payload never references the input tensor; every tensor is contiguous and lives on
    the input's device. ``shape`` is the input's shape; ``order`` (None: row-major) is the
    permutation of its dims that is row-major in memory, the layout the payload describes.
    ``decode`` returns a tensor on the device of the payload, with the input's strides.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    order: tuple[int, ...] | None = None

    def nbytes(self) -> int:
        """Exact bytes the encoding holds on the device: the payload and any tensor in ``meta``
        (int4_outlier's outlier count); python metadata, and payload parked in host memory
        (`runtime.offload`), are not counted."""
        held = [*self.tensors.values(), *self.meta.values()]
        return sum(t.numel() * t.element_size() for t in held if torch.is_tensor(t))

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def stored_shape(self) -> torch.Size:
        """The shape the payload describes (``shape`` with its dims in memory order)."""
        if self.order is None:
            return self.shape
        return torch.Size(self.shape[d] for d in self.order)


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``x`` as a row-major tensor without copying when it is dense with its last dim innermost:
    ``(x.permute(order), order)``; otherwise a contiguous copy and ``None``."""
    if x.is_contiguous():
        return x, None
    if x.dim() >= 2 and x.stride(-1) == 1:
        lead = sorted(range(x.dim() - 1), key=lambda d: -x.stride(d))
        order = (*lead, x.dim() - 1)
        view = x.permute(order)
        if view.is_contiguous():
            return view, order
    return x.contiguous(), None


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


class Codec:
    """Base class of all activation codecs. Subclasses set ``name`` and ``lossless`` and
    implement ``_encode`` / ``_decode`` (the torch reference) on row-major inputs.

    ``backend`` (set by :func:`get_codec`) pins the implementation that runs it (:mod:`.backends`:
    ``"torch"``, ``"inductor"``, ``"triton"`` or a library's); None follows the kernel mode."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    backend: str | None = None

    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode ``x`` (never syncs with the device; see the module doc for non-finite values)."""
        self._check_input(x)
        xm, order = memory_order(x.detach())
        tensors, meta = backends.encode(self, xm)
        return Encoded(self.name, x.shape, x.dtype, tensors, meta, order)

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decoded tensor (``out``, if given: a tensor of the input's shape, dtype and memory
        layout, e.g. ``torch.empty_like(x)``, which is written and returned)."""
        self._check_encoded(enc)
        out_m = None
        if out is not None:
            out_m = out.permute(enc.order) if enc.order is not None else out
            if out_m.shape != enc.stored_shape or out_m.dtype != enc.dtype:
                raise CodecError(f"{self.name}: out has shape {tuple(out.shape)} / {out.dtype}")
            if not out_m.is_contiguous():
                raise CodecError(f"{self.name}: out must have the encoded tensor's memory layout")
        y = backends.decode(self, enc, out_m)
        if out is not None:
            return out
        return y.permute(_inverse(enc.order)) if enc.order is not None else y

    def _encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        """Exact ``encode(x).nbytes()`` for any ``x`` of this shape/dtype (payloads have fixed
        sizes; ``n_outlier_channels`` is accepted for compatibility and ignored)."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """JSON-serialisable constructor parameters: ``get_codec(name, **params())`` rebuilds."""
        return {}

    def applicable(self, x_or_dtype: torch.Tensor | torch.dtype) -> bool:
        """Whether this codec accepts the dtype of ``x_or_dtype``."""
        dtype = x_or_dtype.dtype if isinstance(x_or_dtype, torch.Tensor) else x_or_dtype
        return dtype in self.dtypes

    # -- helpers for subclasses ---------------------------------------------------------

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        self._check_shape_dtype(x.shape, x.dtype)

    def _check_shape_dtype(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        if dtype not in self.dtypes:
            names = ", ".join(str(d) for d in self.dtypes)
            raise CodecError(f"{self.name}: unsupported dtype {dtype} (supported: {names})")
        if math.prod(shape) < 1:
            raise CodecError(f"{self.name}: needs a tensor with >= 1 element, got shape {shape}")

    def _check_encoded(self, enc: Encoded) -> None:
        if enc.codec != self.name:
            raise CodecError(f"{self.name}: cannot decode a payload of codec {enc.codec!r}")

    def __repr__(self) -> str:
        params = {**self.params(), **({"backend": self.backend} if self.backend else {})}
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{type(self).__name__}({args})"


# -- registry ---------------------------------------------------------------------------

_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` available to :func:`get_codec` under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise CodecError(f"codec name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_codecs() -> list[str]:
    """Sorted names of all registered codecs."""
    return sorted(_REGISTRY)


def get_codec(name: str, backend: str | None = None, **params: Any) -> Codec:
    """Build the codec registered as ``name`` with constructor ``params``.

    Args:
        name: A registered codec (:func:`available_codecs`).
        backend: The implementation that runs it (:data:`.backends.BACKENDS`; one the codec has,
            :func:`.backends.backends_of`); None: the kernel mode's choice.
        **params: The codec's constructor parameters (``codec.params()`` gives them back).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    if backend is not None and backend not in backends.backends_of(name):
        raise CodecError(
            f"codec {name!r} has no backend {backend!r}; it has "
            f"{', '.join(backends.backends_of(name))}"
        )
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    sig = inspect.signature(cls.__init__).parameters.values()
    accepted = [p.name for p in sig if p.kind in kinds and p.name != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise CodecError(
            f"codec {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    codec = cls(**params)
    codec.backend = backend
    return codec


def check_int_param(codec: str, pname: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CodecError(f"{codec}: {pname} must be an int >= {minimum}, got {value!r}")
    return value


# -- judging an encoding ------------------------------------------------------------------

_ARITH_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def payload_finite(enc: Encoded) -> bool:
    """True when every float payload tensor (scales, offsets, exact outliers) is finite.

    Syncs with the device: for profiling and tests, never on the training path (codecs encode
    non-finite inputs robustly). FP8 codes are not checked (torch has no ``isfinite`` for them).
    """
    return all(
        bool(torch.isfinite(t).all()) for t in enc.tensors.values() if t.dtype in _ARITH_FLOATS
    )


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype a profile or policy names (``"torch.bfloat16"``); None if torch has none."""
    return getattr(torch, name.removeprefix("torch."), None)


def sentinel_limit(dtype: torch.dtype) -> float:
    """Magnitudes from here on are sentinels (masks), not values: a quarter of the dtype's range."""
    return torch.finfo(dtype).max / 4 if dtype.is_floating_point else float("inf")


def has_sentinels(x: torch.Tensor) -> bool:
    """Whether `x` holds mask sentinels (``-inf``, ``finfo.min``...): lossy codecs keep away from
    such outputs. Reads the tensor (a host sync: for profiling, not for training steps)."""
    return x.is_floating_point() and bool((x.detach().abs() >= sentinel_limit(x.dtype)).any())


#: Elements per piece `relative_error` works on: its float32 temporaries stay within a few MiB
#: whatever the tensor's size (a tracking step measures live activations mid-forward).
ERROR_CHUNK = 1 << 18


def _pieces(x: torch.Tensor, decoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching views of `x` and `decoded` of about `ERROR_CHUNK` elements (along the flat
    order when both are contiguous, else along the first dimension)."""
    if x.is_contiguous() and decoded.is_contiguous():
        a, b = x.reshape(-1), decoded.reshape(-1)
        return list(zip(a.split(ERROR_CHUNK), b.split(ERROR_CHUNK), strict=True))
    if x.dim() == 0:
        return [(x, decoded)]
    rows = max(1, ERROR_CHUNK // max(1, x[0].numel()))
    return list(zip(x.split(rows), decoded.split(rows), strict=True))


def relative_error(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``||decoded - x|| / ||x||`` over the entries backward reads, in float32, as a 0-dim tensor
    on the device (no host sync). The one error metric codecs are judged by (profiler and
    rectifier alike). Computed piece by piece (`ERROR_CHUNK`), so its temporaries stay small.

    Sentinel entries (``-inf`` / ``finfo.min`` masks in attention scores, anything beyond a
    quarter of the dtype's range) are left out of the norms: they dwarf the real values, so an
    error measured with them says nothing about what the mask leaves visible (which a codec may
    ruin). 0 for an exact round trip of an all-zero tensor; inf when a non-finite element of
    ``x`` is not restored exactly (same infinity, or NaN) or a finite one decodes to a
    non-finite value.
    """
    limit = sentinel_limit(x.dtype)
    sq = torch.zeros(2, device=x.device)  # squared norms of the difference and of x
    broken = torch.zeros((), dtype=torch.bool, device=x.device)
    for xp, dp in _pieces(x.detach(), decoded.detach()):
        xf, df = xp.float(), dp.float()
        finite = torch.isfinite(xf)
        regular = xf.abs() < limit
        same = (xf == df) | (torch.isnan(xf) & torch.isnan(df))
        broken |= torch.where(finite, regular & ~torch.isfinite(df), ~same).any()
        sq[0] += torch.where(regular, df - xf, 0.0).square().sum()
        sq[1] += torch.where(regular, xf, 0.0).square().sum()
    diff, base = sq.sqrt().unbind()
    err = diff / base
    err = torch.where(base == 0, torch.where(diff == 0, 0.0, torch.inf), err)
    err = torch.where(broken, torch.inf, err)
    return torch.nan_to_num(err, nan=torch.inf, posinf=torch.inf)
