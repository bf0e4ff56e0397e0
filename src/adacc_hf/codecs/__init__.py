"""Reference (plain torch) activation codecs of adacc-hf.

``get_codec(name, **params)`` builds a :class:`Codec`; ``codec.encode(x)`` returns an
:class:`Encoded` payload and ``codec.decode(enc)`` restores shape, dtype and device.
Codecs: ``int4_outlier``, ``int4_channel``, ``int4_asym``, ``int4_naive`` (lossy INT4) and
``bitpack`` (lossless dropout masks). Layouts are documented in :mod:`.base` and per codec.
"""

from __future__ import annotations

from . import bitpack, int4_asym, int4_channel, int4_naive, int4_outlier  # noqa: F401 (register)
from .base import (
    Codec,
    CodecError,
    Encoded,
    available_codecs,
    get_codec,
    pack_int4,
    unpack_int4,
)

__all__ = [
    "Codec",
    "CodecError",
    "Encoded",
    "available_codecs",
    "get_codec",
    "pack_int4",
    "unpack_int4",
]
