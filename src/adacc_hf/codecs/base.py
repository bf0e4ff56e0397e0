"""Codec base class, payload container, registry and shared INT4 helpers.

Conventions shared by every codec (the Triton kernels must follow them bit for bit):

* "channels" are the LAST dimension of the input, "rows" are all other dims flattened
  (a 0-dim tensor is one row of one channel). Row-major order throughout.
* Arithmetic is float32: the input is converted with ``x.to(torch.float32)`` (exact for
  fp16/bf16/fp32), divisions are IEEE round-to-nearest float32 divisions (use ``div_rn`` in
  Triton, not the approximate ``/``), ``round_half_even`` is ``torch.round``.
* Decode computes in float32 and casts once to the original dtype (round to nearest even).
  Multiply and add are separately rounded float32 ops (no FMA contraction).
* Non-finite inputs (inf/NaN) are not supported: the result is unspecified.

INT4 nibble layout (:func:`pack_int4`): the int8 codes ``q`` in [-8, 7] are flattened
(row-major) and stored as unsigned nibbles ``q + 8`` in 0..15. Element ``2i`` goes to the LOW
nibble of byte ``i`` and element ``2i + 1`` to the HIGH nibble. An odd count is padded with
``q = 0`` (nibble ``8``). Example: ``[-8, 7, 0, 1, -1]`` -> ``[0xF0, 0x98, 0x87]``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from adacc_kernels.layout import group_layout

from ..errors import AdaccError

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class CodecError(AdaccError, ValueError):
    """Bad codec name, bad codec parameters, or an input the codec cannot encode."""


@dataclass
class Encoded:
    """A compressed tensor: payload tensors plus small python metadata.

    The payload never references the input tensor; every tensor is contiguous and lives on
    the input's device. ``decode`` returns a tensor on the device of the payload.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Exact payload size in bytes (python metadata not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


class Codec:
    """Base class of all activation codecs. Subclasses set ``name`` and ``lossless``."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES

    def encode(self, x: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        """Exact ``encode(x).nbytes()`` for any ``x`` of this shape/dtype.

        ``n_outlier_channels`` is only used by codecs with outlier channels; others ignore it.
        """
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
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
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


def get_codec(name: str, **params: Any) -> Codec:
    """Build the codec registered as ``name`` with constructor ``params``."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    sig = inspect.signature(cls.__init__).parameters.values()
    accepted = [p.name for p in sig if p.kind in kinds and p.name != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise CodecError(
            f"codec {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    return cls(**params)


def check_int_param(codec: str, pname: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CodecError(f"{codec}: {pname} must be an int >= {minimum}, got {value!r}")
    return value


# -- shape / INT4 helpers ---------------------------------------------------------------


def rows_channels(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, channels) view of ``shape``: channels = last dim, rows = the rest flattened."""
    channels = int(shape[-1]) if len(shape) > 0 else 1
    return math.prod(shape) // channels, channels


def as_rows_f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a float32 [rows, channels] tensor (may share storage with ``x``: read only)."""
    rows, channels = rows_channels(x.shape)
    return x.reshape(rows, channels).to(torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] into uint8 nibbles (layout in the module docstring)."""
    if q.dtype != torch.int8:
        raise CodecError(f"pack_int4 needs int8 codes, got {q.dtype}")
    nib = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_full((1,), 8)])
    return (nib[0::2] | (nib[1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: the first ``numel`` int8 codes, flat."""
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2:
        raise CodecError(
            f"unpack_int4: expected {(numel + 1) // 2} uint8 bytes, "
            f"got {packed.numel()} x {packed.dtype}"
        )
    nib = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:numel]
    return (nib.to(torch.int16) - 8).to(torch.int8)


def int4_nbytes(numel: int) -> int:
    return (numel + 1) // 2


def quantize_sym(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round_half_even(x / scale), -8, 7)`` as int8; where ``scale == 0``, q = 0.

    ``x`` float32, ``scale`` float32 broadcastable to ``x``.
    """
    zero = scale == 0
    q = torch.round(x / torch.where(zero, torch.ones_like(scale), scale))
    q = torch.where(zero, torch.zeros_like(q), q)
    return q.clamp_(-8, 7).to(torch.int8)


def quantize_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 of float32 [rows, C] in groups of ``group_size`` along the last dim.

    The last dim is zero-padded to a multiple of the group (``group_size == 0``: whole row).
    Per group ``scale = absmax / 7`` (float32). Returns (packed uint8 of the padded
    [rows, Cp] codes, scale [rows, Cp // group]).
    """
    rows, channels = x.shape
    group, padded = group_layout(channels, group_size)
    if padded != channels:
        x = torch.nn.functional.pad(x, (0, padded - channels))
    xg = x.reshape(rows, padded // group, group)
    amax = xg.abs().amax(dim=-1)
    # Divide by a tensor on the device: CUDA turns division by a Python scalar into a multiply
    # by its float32 reciprocal (not the IEEE division the convention above requires).
    scale = amax / amax.new_full((), 7.0)
    q = quantize_sym(xg, scale.unsqueeze(-1))
    return pack_int4(q), scale.contiguous()


def dequantize_groups(
    packed: torch.Tensor, scale: torch.Tensor, channels: int, group_size: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: float32 [rows, channels] = q * scale."""
    rows, n_groups = scale.shape
    group, padded = group_layout(channels, group_size)
    q = unpack_int4(packed, rows * padded).reshape(rows, n_groups, group)
    x = q.to(torch.float32) * scale.unsqueeze(-1)
    return x.reshape(rows, padded)[:, :channels]


def groups_nbytes(rows: int, channels: int, group_size: int) -> int:
    group, padded = group_layout(channels, group_size)
    return int4_nbytes(rows * padded) + rows * (padded // group) * 4


# -- judging an encoding ------------------------------------------------------------------


def payload_finite(enc: Encoded) -> bool:
    """True when every float payload tensor (scales, offsets, exact outliers) is finite."""
    return all(bool(torch.isfinite(t).all()) for t in enc.tensors.values() if t.is_floating_point())


def sentinel_limit(dtype: torch.dtype) -> float:
    """Magnitudes from here on are sentinels (masks), not values: a quarter of the dtype's range."""
    return torch.finfo(dtype).max / 4 if dtype.is_floating_point else float("inf")


def has_sentinels(x: torch.Tensor) -> bool:
    """Whether `x` holds mask sentinels (``-inf``, ``finfo.min``...): lossy codecs keep away from
    such outputs. Reads the tensor (a host sync: for profiling, not for training steps)."""
    return x.is_floating_point() and bool((x.detach().abs() >= sentinel_limit(x.dtype)).any())


def relative_error(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``||decoded - x|| / ||x||`` over the entries backward reads, in float32, as a 0-dim tensor
    on the device (no host sync). The one error metric codecs are judged by (profiler and
    rectifier alike).

    Sentinel entries (``-inf`` / ``finfo.min`` masks in attention scores, anything beyond a
    quarter of the dtype's range) are left out: they dwarf the real values, so an error measured
    with them says nothing about what the mask leaves visible (which a codec may ruin). 0 for an
    exact round trip of an all-zero tensor, inf for a non-finite result.
    """
    xf = x.detach().float()
    regular = xf.abs() < sentinel_limit(x.dtype)
    zero = xf.new_zeros(())
    diff = torch.linalg.vector_norm(torch.where(regular, decoded.detach().float() - xf, zero))
    base = torch.linalg.vector_norm(torch.where(regular, xf, zero))
    err = diff / base
    err = torch.where(base == 0, torch.where(diff == 0, 0.0, torch.inf), err)
    return torch.nan_to_num(err, nan=torch.inf, posinf=torch.inf)
