"""Shared set-up of the kernel tests: Triton's CPU interpreter, reference payloads, bitwise
comparison. Imported by ``test_kernels*.py`` before any kernel module is defined.

Without a GPU the kernels run in Triton's interpreter, which Triton picks when a kernel is
*defined*: TRITON_INTERPRET=1 is set before importing the kernel modules (importing adacc_hf,
kernels or adacc_kernels.ops defines none). triton itself may already be imported (transformers
imports it through torch._dynamo): the kernels avoid the standard-library wrappers that would
then be compiled-mode objects (kernels/_common.py). The variable is removed again once the
kernels are defined and set only while the kernel tests run (:func:`interpreter_env`), so it
does not leak into other test modules.
"""

from __future__ import annotations

import os

import pytest
import torch

_SET_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
except ImportError:
    if _SET_INTERPRET:
        del os.environ["TRITON_INTERPRET"]
    pytest.skip("triton is not installed (pip install 'adacc-hf[triton]')", allow_module_level=True)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    reason = "no GPU, and TRITON_INTERPRET is set to something other than 1"
    pytest.skip(reason, allow_module_level=True)

import adacc_kernels._common as kcommon  # noqa: E402 (after TRITON_INTERPRET)
from adacc_kernels import (  # noqa: E402, F401  # noqa: E402, F401
    bitpack,
    fp8,
    int4_asym,
    int4_channel,
    int4_naive,
    int4_outlier,
    int4_select,
    ops,
)

from adacc_hf.codecs import dispatch, get_codec  # noqa: E402

if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]
if not torch.cuda.is_available() and not kcommon.INTERPRETED:
    raise RuntimeError(
        "kernels were defined before TRITON_INTERPRET=1 was set: some module imported a kernel "
        "module early; run the kernel tests in a fresh process"
    )


@pytest.fixture(autouse=True)
def interpreter_env(monkeypatch):
    """CPU kernel launches check TRITON_INTERPRET=1 at call time (autouse where imported)."""
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
FLOAT_IDS = ["fp32", "fp16", "bf16"]
# Odd shapes: channels not a multiple of the group, odd rows*channels (bytes straddle rows),
# one row, one channel.
SHAPES = [(5, 37), (1, 64), (3, 100), (2, 3), (1, 1), (7, 130), (4, 256)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, seed=0, spread=True) -> torch.Tensor:
    """Gaussian with per-channel magnitudes from 1e-3 to 1e3 (exercises every exponent)."""
    x = torch.randn(shape, generator=gen(seed))
    if spread and len(shape):
        x = x * torch.logspace(-3, 3, shape[-1])
    return x.to(dtype).to(DEVICE)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: compare floats bit for bit (-0.0 != +0.0)."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def _nan(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    return torch.isnan(t) if t.dtype.is_floating_point else torch.zeros_like(t, dtype=torch.bool)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit for bit (-0.0 != +0.0); NaNs match NaNs whatever their payload bits (torch's own
    conversions do not agree on those)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert a.device == b.device, what
    nan_a, nan_b = _nan(a), _nan(b)
    diff = ((bits(a) != bits(b)) & ~(nan_a & nan_b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def reference(name: str, x: torch.Tensor, **params):
    """(codec, reference payload, reference decode) on the torch path."""
    codec = get_codec(name, **params)
    with dispatch.kernel_mode_override("torch"):
        enc = codec.encode(x)
        return codec, enc, codec.decode(enc)


def with_outliers(shape, dtype, seed=0, hot=(1, 4)) -> torch.Tensor:
    """Gaussian with channels ``hot`` 50x larger (when there are that many channels)."""
    x = torch.randn(shape, generator=gen(seed))
    if shape[-1] > max(hot):
        x[..., list(hot)] *= 50.0
    return x.to(dtype).to(DEVICE)
