"""The codec kernels as torch custom ops (``torch.ops.adacc.*``) with fake implementations.

Importing this module registers the ops; it does not import triton (each op imports its kernel
module on first call), so it is safe before ``TRITON_INTERPRET`` is decided. The fake
implementations give output shapes and dtypes without running anything, so ``torch.compile`` /
``torch.export`` can trace through a codec; every output size is fixed by the inputs
(``int4_outlier_encode``'s outlier buffer has ``capacity`` slots, its slot map one entry per
channel), so none is data-dependent.

Inputs of the encode ops are [rows, channels] tensors, read through their strides
(``bitpack_encode``: flat, contiguous);
decode ops take the payload plus the sizes and dtype to rebuild (``[rows, channels]``; bitpack:
flat ``[numel]``). Outputs never alias inputs. The plain functions also take ``out=`` (decode
into a given tensor); the ops are functional. ``DIRECT[name]`` is the undecorated function of
``torch.ops.adacc.<name>``: ``adacc_hf.codecs.dispatch`` calls it in eager mode on plain tensors
(skipping a few microseconds of dispatcher overhead per call) and the op when compiling.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.library import custom_op

from .selection import slot_dtype

__all__ = [
    "bitpack_decode",
    "bitpack_encode",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "int4_asym_decode",
    "int4_asym_encode",
    "int4_channel_decode",
    "int4_channel_encode",
    "int4_naive_decode",
    "int4_naive_encode",
    "int4_outlier_decode",
    "int4_outlier_encode",
    "int4_outlier_encode_with_idx",
]


# The undecorated implementations: eager callers skip the dispatcher (a few microseconds per call).
DIRECT: dict[str, Callable[..., Any]] = {}


def _op(name: str, schema: str) -> Callable[[Callable[..., Any]], Any]:
    """Register ``fn`` as ``torch.ops.adacc.<name>``; keep the plain function in DIRECT."""

    def wrap(fn: Callable[..., Any]) -> Any:
        DIRECT[name] = fn
        return custom_op(f"adacc::{name}", fn, mutates_args=(), schema=schema)

    return wrap


def _padded(channels: int, group_size: int) -> tuple[int, int]:
    group = group_size or channels
    return group, -(-channels // group) * group


def _bytes(numel: int) -> int:
    return (numel + 1) // 2


def _u8(ref: torch.Tensor, n: int) -> torch.Tensor:
    return ref.new_empty((n,), dtype=torch.uint8)


def _f32(ref: torch.Tensor, *shape: int) -> torch.Tensor:
    return ref.new_empty(shape, dtype=torch.float32)


# -- int4_naive ----------------------------------------------------------------------------


@_op(
    "int4_naive_encode",
    "(Tensor x, int group_size) -> (Tensor, Tensor)",
)
def int4_naive_encode(x, group_size):
    from . import int4_naive

    return int4_naive.encode(x, group_size)


@int4_naive_encode.register_fake
def _(x, group_size):
    rows, channels = x.shape
    group, padded = _padded(channels, group_size)
    return _u8(x, _bytes(rows * padded)), _f32(x, rows, padded // group)


@_op(
    "int4_naive_decode",
    "(Tensor q, Tensor scale, int rows, int channels, int group_size, ScalarType dtype) -> Tensor",
)
def int4_naive_decode(q, scale, rows, channels, group_size, dtype, out=None):
    from . import int4_naive

    return int4_naive.decode(q, scale, rows, channels, group_size, dtype, out=out)


@int4_naive_decode.register_fake
def _(q, scale, rows, channels, group_size, dtype):
    return q.new_empty((rows, channels), dtype=dtype)


# -- int4_outlier --------------------------------------------------------------------------


@_op(
    "int4_outlier_encode",
    "(Tensor x, int group_size, float zscore_threshold, int capacity) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def int4_outlier_encode(x, group_size, zscore_threshold, capacity):
    from . import int4_outlier

    return int4_outlier.encode(x, group_size, zscore_threshold, capacity)


@int4_outlier_encode.register_fake
def _(x, group_size, zscore_threshold, capacity):
    rows, channels = x.shape
    group, padded = _padded(channels, group_size)
    k = capacity if channels >= 2 else 0
    return (
        _u8(x, _bytes(rows * padded)),
        _f32(x, rows, padded // group),
        x.new_empty((rows, k)),
        x.new_empty((k,), dtype=torch.int32),
        x.new_empty((), dtype=torch.int32),
        x.new_empty((channels if k else 0,), dtype=slot_dtype(k)),
    )


@_op(
    "int4_outlier_encode_with_idx",
    "(Tensor x, Tensor idx, int group_size) -> (Tensor, Tensor, Tensor, Tensor)",
)
def int4_outlier_encode_with_idx(x, idx, group_size):
    from . import int4_outlier

    return int4_outlier.encode_with_idx(x, idx, group_size)


@int4_outlier_encode_with_idx.register_fake
def _(x, idx, group_size):
    rows, channels = x.shape
    group, padded = _padded(channels, group_size)
    k = idx.shape[0]
    return (
        _u8(x, _bytes(rows * padded)),
        _f32(x, rows, padded // group),
        x.new_empty((rows, k)),
        x.new_empty((channels if k else 0,), dtype=slot_dtype(k)),
    )


@_op(
    "int4_outlier_decode",
    "(Tensor q, Tensor scale, Tensor values, Tensor slot, int rows, int channels, "
    "int group_size, ScalarType dtype) -> Tensor",
)
def int4_outlier_decode(q, scale, values, slot, rows, channels, group_size, dtype, out=None):
    from . import int4_outlier

    return int4_outlier.decode(q, scale, values, slot, rows, channels, group_size, dtype, out=out)


@int4_outlier_decode.register_fake
def _(q, scale, values, slot, rows, channels, group_size, dtype):
    return q.new_empty((rows, channels), dtype=dtype)


# -- int4_channel --------------------------------------------------------------------------


@_op(
    "int4_channel_encode",
    "(Tensor x) -> (Tensor, Tensor)",
)
def int4_channel_encode(x):
    from . import int4_channel

    return int4_channel.encode(x)


@int4_channel_encode.register_fake
def _(x):
    rows, channels = x.shape
    return _u8(x, _bytes(rows * channels)), _f32(x, channels)


@_op(
    "int4_channel_decode",
    "(Tensor q, Tensor scale, int rows, int channels, ScalarType dtype) -> Tensor",
)
def int4_channel_decode(q, scale, rows, channels, dtype, out=None):
    from . import int4_channel

    return int4_channel.decode(q, scale, rows, channels, dtype, out=out)


@int4_channel_decode.register_fake
def _(q, scale, rows, channels, dtype):
    return q.new_empty((rows, channels), dtype=dtype)


# -- int4_asym -----------------------------------------------------------------------------


@_op(
    "int4_asym_encode",
    "(Tensor x) -> (Tensor, Tensor, Tensor)",
)
def int4_asym_encode(x):
    from . import int4_asym

    return int4_asym.encode(x)


@int4_asym_encode.register_fake
def _(x):
    rows, channels = x.shape
    return _u8(x, _bytes(rows * channels)), _f32(x, rows), _f32(x, rows)


@_op(
    "int4_asym_decode",
    "(Tensor q, Tensor scale, Tensor offset, int rows, int channels, ScalarType dtype) -> Tensor",
)
def int4_asym_decode(q, scale, offset, rows, channels, dtype, out=None):
    from . import int4_asym

    return int4_asym.decode(q, scale, offset, rows, channels, dtype, out=out)


@int4_asym_decode.register_fake
def _(q, scale, offset, rows, channels, dtype):
    return q.new_empty((rows, channels), dtype=dtype)


# -- bitpack -------------------------------------------------------------------------------


@_op(
    "bitpack_encode",
    "(Tensor x) -> (Tensor, Tensor, Tensor)",
)
def bitpack_encode(x):
    from . import bitpack

    return bitpack.encode(x)


@bitpack_encode.register_fake
def _(x):
    return (
        _u8(x, (x.shape[0] + 7) // 8),
        x.new_empty(()),
        x.new_empty((2,), dtype=torch.int32),
    )


@_op(
    "bitpack_decode",
    "(Tensor bits, Tensor scale, int numel, ScalarType dtype) -> Tensor",
)
def bitpack_decode(bits, scale, numel, dtype, out=None):
    from . import bitpack

    return bitpack.decode(bits, scale, numel, dtype, out=out)


@bitpack_decode.register_fake
def _(bits, scale, numel, dtype):
    return bits.new_empty((numel,), dtype=dtype)


# -- fp8_e4m3 ------------------------------------------------------------------------------


@_op(
    "fp8_e4m3_encode",
    "(Tensor x) -> (Tensor, Tensor)",
)
def fp8_e4m3_encode(x):
    from . import fp8

    return fp8.encode(x)


@fp8_e4m3_encode.register_fake
def _(x):
    rows, channels = x.shape
    return (
        x.new_empty((rows, channels), dtype=torch.float8_e4m3fn),
        _f32(x, rows, -(-channels // 128)),
    )


@_op(
    "fp8_e4m3_decode",
    "(Tensor q, Tensor scale, ScalarType dtype) -> Tensor",
)
def fp8_e4m3_decode(q, scale, dtype, out=None):
    from . import fp8

    return fp8.decode(q, scale, dtype, out=out)


@fp8_e4m3_decode.register_fake
def _(q, scale, dtype):
    return q.new_empty(q.shape, dtype=dtype)
