"""``bitpack``: lossless 1-bit packing of dropout masks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import dispatch
from .base import FLOAT_DTYPES, Codec, CodecError, Encoded, register

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flattened element ``i`` -> bit ``i % 8`` (LSB first) of byte ``i // 8``; pad with 0."""
    b = bits.reshape(-1).to(torch.uint8)
    pad = -b.numel() % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=b.device)
    return (b.reshape(-1, 8) * w).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a flat bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


@register
class BitpackCodec(Codec):
    """Lossless: bool masks, or float masks whose values are +0.0 or one common ``keep_scale``.

    Payload: ``bits`` uint8 [ceil(n / 8)] (bit set = nonzero) and, for float masks, ``scale``:
    a 0-dim tensor of the original dtype holding ``keep_scale`` (0 when nothing is kept).
    Decoding is bit exact. ``-0.0`` and non-mask values raise :class:`CodecError`.
    """

    name = "bitpack"
    lossless = True
    dtypes = (torch.bool, *FLOAT_DTYPES)

    def encode(self, x: torch.Tensor) -> Encoded:
        self._check_input(x)
        if dispatch.use_kernel(x):
            return dispatch.encode(self, x)
        if x.dtype == torch.bool:
            return Encoded(self.name, x.shape, x.dtype, {"bits": pack_bits(x)}, {})
        nz = x != 0
        vals = x[nz]
        scale = vals[0] if vals.numel() else x.new_zeros(())
        if not bool((vals == scale).all()):  # also rejects NaN
            raise CodecError("bitpack needs a 0-or-scale mask (found >1 distinct nonzero value)")
        if bool(torch.signbit(x[~nz]).any()):
            raise CodecError("bitpack needs a 0-or-scale mask (found -0.0)")
        tensors = {"bits": pack_bits(nz), "scale": scale.clone().contiguous()}
        return Encoded(self.name, x.shape, x.dtype, tensors, {})

    def decode(self, enc: Encoded) -> torch.Tensor:
        self._check_encoded(enc)
        if dispatch.use_kernel(enc.device):
            return dispatch.decode(self, enc)
        bits = unpack_bits(enc.tensors["bits"], enc.shape.numel()).reshape(enc.shape)
        if enc.dtype == torch.bool:
            return bits
        scale = enc.tensors["scale"]
        return torch.where(bits, scale, torch.zeros((), dtype=enc.dtype, device=bits.device))

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        n = torch.Size(shape).numel()
        itemsize = 0 if dtype == torch.bool else torch.empty(0, dtype=dtype).element_size()
        return (n + 7) // 8 + itemsize
