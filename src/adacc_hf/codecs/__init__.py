"""Reference (plain torch) activation codecs of adacc-hf.

``get_codec(name, **params)`` builds a :class:`Codec`; ``codec.encode(x)`` returns an
:class:`Encoded` payload and ``codec.decode(enc)`` restores shape, dtype and device.
Codecs: ``int4_outlier``, ``int4_channel``, ``int4_asym``, ``int4_naive`` (lossy INT4),
``fp8_e4m3`` (lossy FP8), ``bitpack`` (lossless dropout masks), and formats that are a
library's, with that library as a backend: ``nf4``, ``fp4``, ``int8_blockwise`` (bitsandbytes,
:mod:`.bnb`), ``mxfp8``, ``mxfp4`` (torchao's MX, :mod:`.mx`) and ``fp8_rowwise``
(torchao.float8, :mod:`.fp8_rowwise`), chosen with ``codecs=[...]`` (not by default). Layouts
are documented in :mod:`.base` and per codec. Each codec runs on one of its backends
(:mod:`.backends`: the torch reference, the reference compiled by inductor, the Triton kernels of
``adacc_kernels``, a library's kernels), all bit-identical; by default the Triton kernels on CUDA
tensors when triton is installed (:mod:`.dispatch`; ``ADACC_KERNELS``), the reference elsewhere.
"""

from __future__ import annotations

from . import (  # noqa: F401
    backends,
    bitpack,
    bnb,
    bnb_backend,
    fp8,
    fp8_rowwise,
    int4_asym,
    int4_channel,
    int4_naive,
    int4_outlier,
    mx,
)
from .base import (
    Codec,
    CodecError,
    Encoded,
    available_codecs,
    dtype_named,
    get_codec,
    has_sentinels,
    payload_finite,
    relative_error,
)
from .dispatch import (
    KernelError,
    kernel_mode,
    kernel_mode_override,
    refresh_kernel_mode,
    set_kernel_mode,
)
from .int4 import (
    pack_int4,
    unpack_int4,
)

__all__ = [
    "Codec",
    "CodecError",
    "Encoded",
    "KernelError",
    "available_codecs",
    "backends",
    "dtype_named",
    "get_codec",
    "has_sentinels",
    "kernel_mode",
    "kernel_mode_override",
    "pack_int4",
    "payload_finite",
    "refresh_kernel_mode",
    "relative_error",
    "set_kernel_mode",
    "unpack_int4",
]
