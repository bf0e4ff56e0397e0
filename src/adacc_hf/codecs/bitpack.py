"""``bitpack``: lossless 1-bit packing of dropout masks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    FLOAT_DTYPES,
    Codec,
    Encoded,
    register,
)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flattened element ``i`` -> bit ``i % 8`` (LSB first) of byte ``i // 8``; pad with 0."""
    b = bits.reshape(-1).to(torch.uint8)
    pad = -b.numel() % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    # bits shifted into place, not multiplied by their weights: torch 2.13's inductor on a CPU
    # miscompiles the cat followed by a product with a weights tensor and the sum (every byte of a
    # padded mask wrong; the inductor backend's check caught it). At most 255 per byte: the sum
    # fits uint8 (and the payload comes from a plain aten op).
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return (b.reshape(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a flat bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


def mask_scale(x: torch.Tensor) -> torch.Tensor:
    """The 0-dim ``keep_scale`` of a float 0-or-scale mask, found without a host sync: the
    first nonzero value (0 when there is none), or NaN when ``x`` is not such a mask (two
    distinct nonzero values, a NaN, or a ``-0.0``)."""
    flat = x.reshape(-1)
    nz = flat != 0
    first = flat.index_select(0, torch.argmax(nz.to(torch.uint8)).reshape(1)).reshape(())
    scale = torch.where(nz.any(), first, torch.zeros((), dtype=x.dtype, device=x.device))
    bad = (nz & (flat != scale)).any() | (~nz & torch.signbit(flat)).any()
    return torch.where(bad, torch.full_like(scale, torch.nan), scale)


@register
class BitpackCodec(Codec):
    """Lossless: bool masks, or float masks whose values are +0.0 or one common ``keep_scale``.

    Payload: ``bits`` uint8 [ceil(n / 8)] (bit set = nonzero) and, for float masks, ``scale``:
    a 0-dim tensor of the original dtype holding ``keep_scale`` (0 when nothing is kept).
    Decoding is bit exact. A float input that is not such a mask (``-0.0``, NaN, more than one
    nonzero value) gets ``scale = NaN``: its kept elements decode to NaN, loudly wrong instead
    of silently (checking on the host would cost a device sync per encode).
    """

    name = "bitpack"
    lossless = True
    dtypes = (torch.bool, *FLOAT_DTYPES)

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        if x.dtype == torch.bool:
            return {"bits": pack_bits(x)}, {}
        return {"bits": pack_bits(x != 0), "scale": mask_scale(x).contiguous()}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        bits = unpack_bits(enc.tensors["bits"], enc.shape.numel())
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
