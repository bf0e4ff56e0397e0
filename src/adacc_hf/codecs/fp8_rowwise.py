"""``fp8_rowwise``: float8 e4m3fn with one float32 scale per row, as ``torchao.float8``'s rowwise
recipe casts a linear's input, with torchao's own functions as a backend (``"torchao"``).

The reference reproduces torchao 0.18's ``float8_utils.tensor_to_scale`` (axiswise along the
last dim; ``round_scales_to_power_of_2`` as the ``ROWWISE`` recipe sets it), the cast of
``float8_training_tensor._ToFloat8ConstrFunc`` (``to_fp8_saturated``) and the inverse of
``_FromFloat8ConstrFunc`` bit for bit. Plain torch: the backend runs wherever torch does
(checked on CPU and CUDA).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

from . import backends
from .base import Codec, CodecError, Encoded, register
from .blockwise import canonical_nan, e4m3_decode, to_e4m3
from .int4 import rows_channels
from .library import library_check

FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # torchao's EPS: the smallest amax a scale is computed from


@register
class Fp8RowwiseCodec(Codec):
    """Per row (all dims but the last): ``amax = max |x|`` (in the input dtype, exact);
    ``scale = float32((1 / max(float64(amax), 1e-12)) * 448)`` (float64 reciprocal then
    multiply, as torchao's ``448 / amax`` computes it), rounded down to a power of two with
    ``exp2(floor(log2(scale)))`` when ``round_scales_to_power_of_2`` (the default: torchao's
    ``ROWWISE`` recipe); ``q = e4m3(clamp(float32(x) * scale, -448, 448))`` (round to nearest
    even). Decode ``float32(q) / scale`` (an IEEE division of the codes cast to the input dtype,
    exact, as torchao casts them), one cast to the input dtype.
    Payload: ``q`` float8_e4m3fn [rows, C], ``scale`` float32 [rows].

    Non-finite inputs (torchao's behaviour): a row holding a NaN has a NaN scale and decodes to
    NaN throughout; a row holding an inf (and no NaN) has scale 0: every element decodes to NaN.
    The profiler refuses such round trips. NaN codes are 0x7F and a NaN scale the canonical NaN
    in the reference; torchao leaves the sign the arithmetic gave (inf * 0 sets it on x86).
    """

    name = "fp8_rowwise"
    lossless = False

    def __init__(self, round_scales_to_power_of_2: bool = True) -> None:
        if not isinstance(round_scales_to_power_of_2, bool):
            raise CodecError(
                f"{self.name}: round_scales_to_power_of_2 must be a bool, "
                f"got {round_scales_to_power_of_2!r}"
            )
        self.round_scales_to_power_of_2 = round_scales_to_power_of_2

    def params(self) -> dict:
        return {"round_scales_to_power_of_2": self.round_scales_to_power_of_2}

    def _encode(self, x: torch.Tensor) -> tuple[dict, dict]:
        rows, channels = rows_channels(x.shape)
        xr = x.reshape(rows, channels)
        amax = xr.abs().amax(-1, keepdim=True)
        scale = (amax.to(torch.float64).clamp(min=AMAX_FLOOR).reciprocal() * FP8_MAX).to(
            torch.float32
        )
        if self.round_scales_to_power_of_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        y = xr.to(torch.float32) * scale
        q = to_e4m3(y.clamp(-FP8_MAX, FP8_MAX))
        return {"q": q, "scale": canonical_nan(scale.reshape(rows))}, {}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        # torchao divides the codes cast to the input dtype (exact) by the float32 scale: a
        # float32 quotient (type promotion), then one cast
        y = e4m3_decode(enc.tensors["q"]) / enc.tensors["scale"][:, None]
        return canonical_nan(y).to(enc.dtype)

    def predict_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, n_outlier_channels: int = 0
    ) -> int:
        self._check_shape_dtype(shape, dtype)
        rows, channels = rows_channels(shape)
        return rows * channels + 4 * rows


# -- the torchao backend -----------------------------------------------------------------


def _torchao_encode(codec: Fp8RowwiseCodec, x: torch.Tensor) -> tuple[dict, dict]:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    rows, channels = rows_channels(x.shape)
    xr = x.reshape(rows, channels)
    scale = tensor_to_scale(
        xr,
        torch.float8_e4m3fn,
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=codec.round_scales_to_power_of_2,
    )
    # the cast of _ToFloat8ConstrFunc.forward (which wraps the result in a tensor subclass)
    q = to_fp8_saturated(xr.to(torch.float32) * scale, torch.float8_e4m3fn)
    return {"q": q, "scale": scale.reshape(rows)}, {}


def _torchao_decode(codec: Fp8RowwiseCodec, enc: Encoded) -> torch.Tensor:
    from torchao.float8.float8_training_tensor import _FromFloat8ConstrFunc

    # the arithmetic of Float8TrainingTensor.to_original_precision, on the payload's tensors
    # (no subclass: decode runs inside the runtime's dispatch modes)
    view = types.SimpleNamespace(
        _data=enc.tensors["q"], _scale=enc.tensors["scale"][:, None], _orig_dtype=enc.dtype
    )
    return _FromFloat8ConstrFunc.forward(None, view).to(enc.dtype)


backends.register_backend(
    "fp8_rowwise",
    "torchao",
    backends.LibraryBackend(
        _torchao_encode,
        _torchao_decode,
        library_check(
            ["torchao.float8.float8_utils", "torchao.float8.float8_training_tensor"],
            "0.18",
            ["cpu", "cuda"],
            "torchao's float8 casts are checked on CPU and CUDA",
        ),
    ),
)
