"""Triton codec kernels against the torch references (on CPU through Triton's interpreter).

Layers, each tested alone: the launch functions of ``adacc_kernels.*`` (payload vs the reference), the
custom ops ``torch.ops.adacc.*`` (fake implementations, opcheck, tracing), the codec dispatch
(mode switch; kernel path vs reference path through ``get_codec``), a short training run on both
paths, and the benchmark script's smoke mode.

Exactness: payload bytes, scales, offsets, outlier values / indices and decoded tensors are
compared bit for bit, for float32, float16 and bfloat16. There is no bf16 exception: Triton's
interpreter truncates float32 -> bfloat16 casts (GPUs round to nearest even), so the kernels
round by hand and match ``Tensor.to(torch.bfloat16)`` on both (tested below). The one
documented difference: ``int4_outlier`` sums columns in a different order than ``torch.sum``,
so a channel whose z-score lies within float32 rounding of the threshold could be classified
differently; the tests check the selection is equal on data without such near-ties, and that
given the same selection the payload is bit-identical.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_support import (  # first: sets up Triton's interpreter before kernels are defined
    DEVICE,
    FLOAT_IDS,
    FLOATS,
    SHAPES,
    assert_bits_equal,
    interpreter_env,  # noqa: F401 (autouse fixture)
    reference,
)
from kernel_support import bits as _bits
from kernel_support import gen as _gen
from kernel_support import randn as _randn
from kernel_support import with_outliers as _with_outliers

# isort: split
import adacc_kernels._common as kcommon
from adacc_kernels import bitpack as kbitpack
from adacc_kernels import fp8 as kfp8
from adacc_kernels import int4_asym as kasym
from adacc_kernels import int4_channel as kchannel
from adacc_kernels import int4_naive as knaive
from adacc_kernels import int4_outlier as koutlier
from adacc_kernels import ops as kops

from adacc_hf.codecs import Encoded, dispatch, get_codec, pack_int4

REPO = Path(__file__).resolve().parents[2]


# -- layer 1: launch functions vs reference ----------------------------------------------


@pytest.mark.parametrize("group_size", [0, 32, 3])
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_naive_kernels_match_reference_bit_for_bit(dtype, group_size):
    for shape in SHAPES:
        x = _randn(shape, dtype)
        _, ref, ref_out = reference("int4_naive", x, group_size=group_size)
        q, scale = knaive.encode(x, group_size)
        assert_bits_equal(q, ref.tensors["q"], f"q {shape}")
        assert_bits_equal(scale, ref.tensors["scale"], f"scale {shape}")
        out = knaive.decode(q, scale, *shape, group_size, dtype)
        assert_bits_equal(out, ref_out, f"decode {shape}")


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_asym_kernels_match_reference_bit_for_bit(dtype):
    softmax = torch.softmax(3 * torch.randn(6, 40, generator=_gen(1)), -1).to(dtype).to(DEVICE)
    constant = torch.tensor([[2.0] * 16, [-0.3] * 16, [1e-3] * 16], dtype=dtype, device=DEVICE)
    for x in [*(_randn(s, dtype) + 2 for s in SHAPES), softmax, constant]:
        _, ref, ref_out = reference("int4_asym", x)
        q, scale, offset = kasym.encode(x)
        for got, key in ((q, "q"), (scale, "scale"), (offset, "offset")):
            assert_bits_equal(got, ref.tensors[key], f"{key} {tuple(x.shape)}")
        assert_bits_equal(kasym.decode(q, scale, offset, *x.shape, dtype), ref_out, "decode")


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_channel_kernels_match_reference_bit_for_bit(dtype):
    for shape in [*SHAPES, (33, 48)]:
        x = _randn(shape, dtype)
        _, ref, ref_out = reference("int4_channel", x)
        q, scale = kchannel.encode(x)
        assert_bits_equal(q, ref.tensors["q"], f"q {shape}")
        assert_bits_equal(scale, ref.tensors["scale"], f"scale {shape}")
        assert_bits_equal(kchannel.decode(q, scale, *shape, dtype), ref_out, f"decode {shape}")


def _koutlier_encode(x, group_size, threshold, fraction=1 / 32):
    codec = get_codec("int4_outlier", group_size=group_size, max_outlier_fraction=fraction)
    return koutlier.encode(x, group_size, threshold, codec.capacity(x.shape[-1]))


def _assert_outlier_payload(x, group_size, enc_tuple):
    q, scale, values, idx, count, slot = enc_tuple
    _, ref, ref_out = reference("int4_outlier", x, group_size=group_size)
    assert_bits_equal(count, ref.meta["outlier_count"], "count")
    assert_bits_equal(idx, ref.tensors["outlier_idx"], f"outlier_idx {tuple(x.shape)}")
    assert_bits_equal(slot, ref.tensors["outlier_slot"], "outlier_slot")
    assert_bits_equal(values, ref.tensors["outlier_values"], "outlier_values")
    assert_bits_equal(q, ref.tensors["q"], "q")
    assert_bits_equal(scale, ref.tensors["scale"], "scale")
    out = koutlier.decode(q, scale, values, slot, *x.shape, group_size, x.dtype)
    assert_bits_equal(out, ref_out, "decode")


@pytest.mark.parametrize("group_size", [64, 4, 3])
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_outlier_kernels_select_the_reference_channels_and_match_bit_for_bit(
    dtype, group_size
):
    for shape in [*SHAPES, (40, 150)]:
        x = _with_outliers(shape, dtype)
        _assert_outlier_payload(x, group_size, _koutlier_encode(x, group_size, 3.0))
    # no outliers (gaussian), std == 0 (constant), a single channel, and the pinned tie z == 3.0
    for x in [
        _randn((16, 96), dtype, spread=False),
        torch.ones(5, 8, dtype=dtype, device=DEVICE),
        _randn((6, 1), dtype) * 100,
    ]:
        _assert_outlier_payload(x, group_size, _koutlier_encode(x, group_size, 3.0))
    x = torch.tensor([[1.0] * 9 + [100.0]], dtype=dtype, device=DEVICE)
    assert _koutlier_encode(x, group_size, 2.5)[3].tolist() == [9]


def test_int4_outlier_selection_equals_torch_over_many_heavy_tailed_inputs():
    for seed in range(12):
        g = _gen(seed)
        x = torch.randn(64, 96, generator=g) * torch.rand(96, generator=g).pow(6).mul(30).add(1)
        x = x.to(DEVICE)
        _, ref, _ = reference("int4_outlier", x)
        assert torch.equal(_koutlier_encode(x, 64, 3.0)[3], ref.tensors["outlier_idx"])


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_outlier_with_a_given_selection_matches_reference_bit_for_bit(dtype):
    x = _with_outliers((9, 77), dtype, seed=3, hot=(0, 40, 76))
    _, ref, _ = reference("int4_outlier", x, group_size=16)
    idx = ref.tensors["outlier_idx"]
    assert idx.tolist() == [0, 40, 76]  # capacity ceil(77 / 32) = 3: every slot used
    q, scale, values, slot = kops.int4_outlier_encode_with_idx(x, idx, 16)
    for got, key in (
        (q, "q"),
        (scale, "scale"),
        (values, "outlier_values"),
        (slot, "outlier_slot"),
    ):
        assert_bits_equal(got, ref.tensors[key], key)


def test_segments_wider_than_a_register_tile_are_processed_in_chunks_bit_exactly(monkeypatch):
    monkeypatch.setattr(kcommon, "MAX_SEGMENT_WIDTH", 16)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(3, 100), (2, 37)]:
            x = _randn(shape, dtype)
            _, ref, _ = reference("int4_naive", x)
            assert_bits_equal(knaive.encode(x, 0)[0], ref.tensors["q"], "naive q")
            _, ref, _ = reference("int4_asym", x)
            assert_bits_equal(kasym.encode(x)[0], ref.tensors["q"], "asym q")
        x = _with_outliers((5, 130), dtype)  # group 64 > 16: separate column-sum pass
        _assert_outlier_payload(x, 64, _koutlier_encode(x, 64, 3.0))


def test_many_channels_in_one_row_match_reference():
    x = _randn((2, 5000), torch.bfloat16)  # wider than MAX_SEGMENT_WIDTH: chunked rows
    for name, got in [("int4_naive", knaive.encode(x, 0)[0]), ("int4_asym", kasym.encode(x)[0])]:
        _, ref, _ = reference(name, x)
        assert_bits_equal(got, ref.tensors["q"], name)


def _e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value (both signs)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    v = codes.to(torch.float32)
    return v[torch.isfinite(v)]


def test_fp8_kernels_match_torch_float8_conversion_on_every_code_and_tie():
    v = _e4m3_values().unique()  # sorted, -448 .. 448
    ties = (v[1:] + v[:-1]) / 2  # exact midpoints: round half to even
    between = v[:-1] + (v[1:] - v[:-1]) * torch.rand(v.numel() - 1, generator=_gen(0))
    vals = torch.cat([v, ties, between, torch.tensor([-0.0, 1e-9, -1e-9])])
    pad = -vals.numel() % 127
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, 127)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1).to(DEVICE)  # scale 1
    _, ref, ref_out = reference("fp8_e4m3", x)
    assert torch.equal(ref.tensors["scale"], torch.ones_like(ref.tensors["scale"]))
    q, scale = kfp8.encode(x)
    assert_bits_equal(q, ref.tensors["q"], "codes")
    assert_bits_equal(kfp8.decode(q, scale, torch.float32), ref_out, "decode")


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_fp8_kernels_match_reference_bit_for_bit(dtype):
    for shape in [*SHAPES, (3, 300)]:
        x = _randn(shape, dtype)
        _, ref, ref_out = reference("fp8_e4m3", x)
        q, scale = kfp8.encode(x)
        assert_bits_equal(q, ref.tensors["q"], f"q {shape}")
        assert_bits_equal(scale, ref.tensors["scale"], f"scale {shape}")
        assert_bits_equal(kfp8.decode(q, scale, dtype), ref_out, f"decode {shape}")


@pytest.mark.parametrize("dtype", [torch.bool, *FLOATS], ids=["bool", *FLOAT_IDS])
def test_bitpack_kernels_are_lossless_and_match_reference(dtype):
    for n in (1, 7, 8, 9, 3 * 5 * 17, 1000):
        for p in (0.0, 0.1, 0.5, 1.0):
            keep = torch.rand(n, generator=_gen(n)) >= p
            x = keep if dtype == torch.bool else keep.to(dtype) * torch.tensor(1.25, dtype=dtype)
            x = x.to(DEVICE)
            _, ref, _ = reference("bitpack", x)
            bits, scale, flags = kbitpack.encode(x)
            assert_bits_equal(bits, ref.tensors["bits"], "bits")
            assert flags.tolist() == [0, 0]
            if dtype != torch.bool:
                assert_bits_equal(scale, ref.tensors["scale"], "scale")
            assert_bits_equal(kbitpack.decode(bits, scale, n, dtype), x, "decode")


@pytest.mark.parametrize(
    ("bad", "flags"),
    [
        (torch.tensor([0.0, 1.0, 2.0]), [1, 0]),
        (torch.tensor([0.0, float("nan"), float("nan")]), [1, 0]),
        (torch.tensor([1.0, -0.0]), [0, 1]),
    ],
)
def test_bitpack_kernel_path_poisons_non_masks_with_nan_like_the_reference(bad, flags):
    _, _, got_flags = kbitpack.encode(bad.to(DEVICE))
    assert got_flags.tolist() == flags
    codec = get_codec("bitpack")
    for mode in ("triton", "torch"):
        with dispatch.kernel_mode_override(mode):
            enc = codec.encode(bad.to(DEVICE))
            assert torch.isnan(enc.tensors["scale"])
            y = codec.decode(enc)
        assert torch.equal(torch.isnan(y), bad.to(DEVICE) != 0), mode


NONFINITE_CASES = [
    ("int4_naive", {}),
    ("int4_naive", {"group_size": 32}),
    ("int4_naive", {"group_size": 3}),
    ("int4_outlier", {}),
    ("int4_outlier", {"group_size": 3}),
    ("int4_channel", {}),
    ("int4_asym", {}),
    ("fp8_e4m3", {}),
]


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize(("name", "params"), NONFINITE_CASES)
def test_non_finite_inputs_give_the_reference_payload_and_decode_bit_for_bit(name, params, dtype):
    """-inf / +inf / NaN: flagged segments (sign bit of the scale) and marker codes match the
    reference; decoding restores them (NaN payload bits aside); no host sync on either path."""
    from sync_count import SyncCounter

    codec = get_codec(name, **params)
    for shape in [(5, 37), (3, 100), (2, 3), (7, 130)]:
        x = _with_outliers(shape, dtype).float()
        x.view(-1)[0] = -math.inf
        x.view(-1)[3] = math.nan
        x.view(-1)[5] = math.inf
        x[-1] = -math.inf  # a row with nothing finite
        x = x.to(dtype).to(DEVICE)
        _, ref, ref_out = reference(name, x, **params)
        with dispatch.kernel_mode_override("triton"), SyncCounter() as syncs:
            enc = codec.encode(x)
            out = codec.decode(enc)
        assert syncs.total == 0, syncs.ops
        for key in ref.tensors:
            assert_bits_equal(enc.tensors[key], ref.tensors[key], f"{name} {key} {shape}")
        assert_bits_equal(out, ref_out, f"{name} decode {shape}")
        assert torch.equal(torch.isnan(out), torch.isnan(x))
        inf = torch.isinf(x)
        assert torch.equal(out[inf], x[inf])


@pytest.mark.parametrize(
    "name", ["int4_outlier", "int4_channel", "int4_asym", "fp8_e4m3", "bitpack"]
)
def test_kernels_decode_into_a_given_out_tensor_and_permuted_inputs_are_not_copied(name):
    codec = get_codec(name)
    base = _with_outliers((2, 5, 3, 64), torch.bfloat16)
    if name == "bitpack":
        base = (base > 0).to(torch.bfloat16) * 2
    x = base.transpose(1, 2)  # dense, leading dims permuted in memory
    _, _, ref_out = reference(name, x)
    with dispatch.kernel_mode_override("triton"):
        enc = codec.encode(x)
        out = torch.empty_like(x)
        got = codec.decode(enc, out=out)
    assert got is out and out.stride() == x.stride() and enc.order == (0, 2, 1, 3)
    assert_bits_equal(out, ref_out, name)


def test_bf16_decode_rounds_to_nearest_even_like_torch_not_by_truncation():
    # q in -8..7 times scales with long mantissas: many products fall between bf16 values,
    # some exactly halfway. Truncation (the interpreter's native cast) would differ.
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(64)
    scale = (1 + torch.arange(64, dtype=torch.float32) / 1024).repeat_interleave(16)
    packed = pack_int4(q).to(DEVICE)
    scale_rows = scale.reshape(64, 16)[:, :1].contiguous().to(DEVICE)
    codec = get_codec("int4_naive")
    enc = Encoded(
        "int4_naive", torch.Size([64, 16]), torch.bfloat16, {"q": packed, "scale": scale_rows}
    )
    with dispatch.kernel_mode_override("torch"):
        ref = codec.decode(enc)
    out = knaive.decode(packed, scale_rows, 64, 16, 0, torch.bfloat16)
    assert_bits_equal(out, ref, "bf16 decode")
    exact = q.reshape(64, 16).float().to(DEVICE) * scale_rows
    truncated = (exact.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert not torch.equal(_bits(truncated), _bits(ref))  # the test can tell the two apart


# -- layer 2: custom ops -----------------------------------------------------------------


def _op_cases():
    x = _randn((6, 70), torch.bfloat16)
    mask = (torch.rand(37, generator=_gen(0)) > 0.5).to(DEVICE)
    fmask = mask.to(torch.float16) * 2
    q4, s4 = knaive.encode(x, 32)
    qc, sc = kchannel.encode(x)
    qa, sa, oa = kasym.encode(x)
    qo, so, vo, io, _, slo = koutlier.encode(_with_outliers((6, 70), torch.bfloat16), 32, 3.0, 3)
    q8, s8 = kfp8.encode(x)
    bits, bscale, _ = kbitpack.encode(fmask)
    return [
        ("int4_naive_encode", (x, 32)),
        ("int4_naive_decode", (q4, s4, 6, 70, 32, torch.bfloat16)),
        ("int4_channel_encode", (x,)),
        ("int4_channel_decode", (qc, sc, 6, 70, torch.bfloat16)),
        ("int4_asym_encode", (x,)),
        ("int4_asym_decode", (qa, sa, oa, 6, 70, torch.bfloat16)),
        ("int4_outlier_encode", (x, 32, 3.0, 3)),
        ("int4_outlier_encode_with_idx", (x, io, 32)),
        ("int4_outlier_decode", (qo, so, vo, slo, 6, 70, 32, torch.bfloat16)),
        ("fp8_e4m3_encode", (x,)),
        ("fp8_e4m3_decode", (q8, s8, torch.bfloat16)),
        ("bitpack_encode", (mask,)),
        ("bitpack_encode", (fmask,)),
        ("bitpack_decode", (bits, bscale, 37, torch.float16)),
    ]


def test_every_kernel_is_a_custom_op_whose_fake_impl_matches_real_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cases = _op_cases()
    assert {name for name, _ in cases} == set(kops.DIRECT) == set(kops.__all__)
    for name, args in cases:
        op = getattr(torch.ops.adacc, name)
        real = op(*args)
        real = real if isinstance(real, tuple) else (real,)
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fargs = [
                mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            fake = op(*fargs)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(fake) == len(real), name
        for f, r in zip(fake, real, strict=False):
            assert f.dtype == r.dtype and f.device == r.device, name
            # every size is fixed by the inputs (the outlier buffer by its capacity)
            assert all(isinstance(d, int) for d in f.shape), (name, f.shape)
            assert tuple(f.shape) == tuple(r.shape), (name, f.shape, r.shape)


def test_custom_ops_pass_torch_library_opcheck():
    seen = set()
    for name, args in _op_cases():
        if name in seen:
            continue
        seen.add(name)
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
        if name.startswith("fp8"):  # opcheck's schema check multiplies outputs: no fp8 mul on CPU
            utils = utils[1:]
        torch.library.opcheck(
            getattr(torch.ops.adacc, name).default,
            args,
            test_utils=(*utils, "test_aot_dispatch_dynamic"),
        )


def test_codec_ops_trace_into_an_fx_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    def roundtrip(x):
        q, s = torch.ops.adacc.int4_naive_encode(x, 32)
        return torch.ops.adacc.int4_naive_decode(q, s, 6, 70, 32, torch.bfloat16)

    graph = make_fx(roundtrip, tracing_mode="fake")(_randn((6, 70), torch.bfloat16))
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"adacc.int4_naive_encode.default", "adacc.int4_naive_decode.default"} <= targets


# -- layer 3: codec dispatch -------------------------------------------------------------

CODECS = ["int4_outlier", "int4_channel", "int4_asym", "int4_naive", "fp8_e4m3", "bitpack"]


@pytest.mark.parametrize("name", CODECS)
def test_kernel_path_and_reference_path_payloads_are_identical_and_interchangeable(name):
    shapes = [(2, 3, 65), (7,), (), (1, 1), (4, 16, 48)]
    for dtype in FLOATS:
        for shape in shapes:
            x = _with_outliers(shape, dtype) if shape else _randn(shape, dtype)
            if name == "bitpack":  # a float 0-or-scale mask, and for float16 a bool mask
                keep = x.float() > 0
                x = keep if dtype == torch.float16 else keep.to(dtype) * 3
            if len(shape) == 3:
                x = x.transpose(0, 1)  # non-contiguous input
            codec, ref, ref_out = reference(name, x)
            with dispatch.kernel_mode_override("triton"):
                enc = codec.encode(x)
                out = codec.decode(enc)
                cross = codec.decode(ref)  # kernel decodes a reference payload
            with dispatch.kernel_mode_override("torch"):
                cross_back = codec.decode(enc)  # reference decodes a kernel payload
            assert enc.codec == name and enc.shape == x.shape and enc.dtype == x.dtype
            assert enc.meta.keys() == ref.meta.keys() and enc.tensors.keys() == ref.tensors.keys()
            assert enc.order == ref.order
            for key in ref.meta:
                assert_bits_equal(enc.meta[key], ref.meta[key], f"{name} meta {key}")
            for key in ref.tensors:
                assert enc.tensors[key].is_contiguous()
                assert_bits_equal(enc.tensors[key], ref.tensors[key], f"{name} {key} {shape}")
            n_out = 0  # fixed-size payloads
            assert enc.nbytes() == codec.predict_nbytes(x.shape, x.dtype, n_out)
            for got in (out, cross, cross_back):
                assert_bits_equal(got, ref_out, f"{name} decode {shape} {x.dtype}")


def test_codec_glue_through_the_custom_ops_gives_the_same_payloads(monkeypatch):
    # Eager calls skip the dispatcher; under torch.compile the glue calls torch.ops.adacc.*.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for name in CODECS:
        x = _with_outliers((6, 70), torch.bfloat16)
        if name == "bitpack":
            x = x > 0
        codec, ref, ref_out = reference(name, x)
        with dispatch.kernel_mode_override("triton"):
            enc = codec.encode(x)
            out = codec.decode(enc)
        for key in ref.tensors:
            assert_bits_equal(enc.tensors[key], ref.tensors[key], f"{name} {key}")
        assert_bits_equal(out, ref_out, f"{name} decode")


# Measured on randn(128, 512), seed 0, all three dtypes (kernel path = reference path, bit for
# bit): int4_outlier 19.4 dB, int4_channel 19.5, int4_asym 19.0, int4_naive 17.4, fp8_e4m3 31.8.
SNR_FLOOR_DB = {
    "int4_outlier": 18.5,
    "int4_channel": 18.0,
    "int4_asym": 18.0,
    "int4_naive": 16.5,
    "fp8_e4m3": 30.5,
}


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("name", sorted(SNR_FLOOR_DB))
def test_kernel_round_trip_snr_is_above_floor(name, dtype):
    x = torch.randn(128, 512, generator=_gen(0)).to(dtype).to(DEVICE)
    codec = get_codec(name)
    with dispatch.kernel_mode_override("triton"):
        y = codec.decode(codec.encode(x))
    x, y = x.float(), y.float()
    snr = 10 * math.log10(x.pow(2).mean().item() / (y - x).pow(2).mean().item())
    assert snr >= SNR_FLOOR_DB[name]


@pytest.fixture
def kernel_env(monkeypatch):
    """``kernel_env(value)`` sets (None: removes) $ADACC_KERNELS mid-test and refreshes the
    resolved mode, as a process changing it mid-run must; restored and refreshed after."""

    def set_env(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(dispatch.ENV_VAR, value)
        dispatch.refresh_kernel_mode()

    yield set_env
    monkeypatch.undo()
    dispatch.refresh_kernel_mode()


def test_kernel_mode_comes_from_override_then_env_then_auto(kernel_env, monkeypatch):
    kernel_env(None)
    assert dispatch.kernel_mode() == "auto"
    kernel_env("torch")
    assert dispatch.kernel_mode() == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # read once: a change needs a refresh
    assert dispatch.kernel_mode() == "torch"
    kernel_env("torch")
    with dispatch.kernel_mode_override("triton"):
        assert dispatch.kernel_mode() == "triton"
        with dispatch.kernel_mode_override("auto"):
            assert dispatch.kernel_mode() == "auto"
        assert dispatch.kernel_mode() == "triton"
    assert dispatch.kernel_mode() == "torch"
    dispatch.set_kernel_mode("triton")
    try:
        assert dispatch.kernel_mode() == "triton"
    finally:
        dispatch.set_kernel_mode(None)
    assert dispatch.kernel_mode() == "torch"


def test_unknown_kernel_mode_is_rejected_naming_the_choices(kernel_env):
    with pytest.raises(dispatch.KernelError, match="auto, triton, torch"):
        dispatch.set_kernel_mode("cuda")
    kernel_env("fast")
    with pytest.raises(dispatch.KernelError, match="ADACC_KERNELS"):
        dispatch.kernel_mode()


def test_torch_mode_never_uses_kernels_and_auto_uses_them_only_on_cuda():
    x = torch.zeros(4, 4, device=DEVICE)
    with dispatch.kernel_mode_override("torch"):
        assert not dispatch.use_kernel(x)
    with dispatch.kernel_mode_override("auto"):
        expected = x.is_cuda and dispatch.kernels_available() and dispatch._supported_gpu(x.device)
        assert dispatch.use_kernel(x) == expected
        assert not dispatch.use_kernel(torch.zeros(2))  # CPU: always the reference


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only behaviour")
def test_forcing_kernels_on_cpu_without_the_interpreter_raises_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with (
        dispatch.kernel_mode_override("triton"),
        pytest.raises(dispatch.KernelError, match="TRITON_INTERPRET=1"),
    ):
        get_codec("int4_naive").encode(torch.randn(4, 8))


def test_importing_adacc_hf_and_kernels_never_initialises_cuda_and_kernels_import_lazily():
    code = (
        "import sys, torch\n"
        "import adacc_kernels, adacc_kernels.ops\n"
        "assert 'triton' not in sys.modules, 'kernels imported triton eagerly'\n"
        "import adacc_hf\n"
        "from adacc_hf.codecs import get_codec\n"
        "get_codec('int4_naive').encode(torch.randn(4, 8))  # CPU, auto mode: the reference\n"
        "assert not [m for m in sys.modules if m.startswith('adacc_kernels.int4')], 'kernel modules'\n"
        "assert not torch.cuda.is_initialized(), 'cuda initialised'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# -- layer 4: training equivalence -------------------------------------------------------


def test_training_losses_are_identical_on_kernel_and_reference_paths():
    import adacc_hf
    from adacc_hf import assets

    def train(mode: str) -> tuple[list[float], list[torch.Tensor]]:
        model = assets.tiny_model("llama").to(DEVICE)
        batch = assets.tiny_batch("llama", model)
        policy = adacc_hf.uniform_policy(model, "compress", batch)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        torch.manual_seed(0)
        with dispatch.kernel_mode_override(mode), adacc_hf.apply_adacc(model, policy):
            for _ in range(3):
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = train("torch")
    losses, params = train("triton")
    assert ref_losses[-1] < ref_losses[0]
    if DEVICE == "cpu":
        # Tolerance: none. Every codec is bit-exact (and the outlier selection agrees on this
        # data), so the float32 run is reproduced exactly.
        assert losses == ref_losses
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    else:
        # On CUDA two reference runs can already differ in the last bits (atomics in e.g. the
        # embedding backward): relative 1e-5 on the losses.
        assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("codec", ["int4_outlier", "int4_channel", "int4_asym", "fp8_e4m3"])
def test_kernel_path_training_step_adds_no_host_syncs(codec):
    """The Triton path through the runtime: no more host syncs than the unpatched model (every
    payload size is known from shapes; flags and counts stay on the device)."""
    from sync_count import SyncCounter

    import adacc_hf
    from adacc_hf import assets
    from adacc_hf.schema import CODEC_FOR_LAYER

    model = assets.tiny_model("llama").to(DEVICE)
    batch = assets.tiny_batch("llama", model)
    policy = adacc_hf.uniform_policy(
        model, "compress", batch, codecs=dict.fromkeys(CODEC_FOR_LAYER, codec)
    )
    with SyncCounter() as plain:
        model(**batch).loss.backward()
    with dispatch.kernel_mode_override("triton"), adacc_hf.apply_adacc(model, policy) as h:
        model(**batch).loss.backward()  # builds the slot tables
        with SyncCounter() as patched:
            model(**batch).loss.backward()
        assert sum(h.cached_bytes().values()) > 0
    assert patched.ops == plain.ops


# -- benchmark script --------------------------------------------------------------------


def test_benchmark_smoke_mode_runs_every_codec_and_writes_json(tmp_path):
    out = tmp_path / "codecs-smoke.json"
    # --smoke runs Triton's interpreter; on a GPU the same tiny run compiles the kernels instead
    # (older Triton interpreters cannot run these kernels: range() over a launch argument)
    where = ["--device", "cuda", "--sizes-mb", "0.0625", "--channels", "256", "--reps", "2"]
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_codecs.py"),
        *(where if torch.cuda.is_available() else ["--smoke"]),
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"device", "torch", "triton", "command", "copy_gbps", "results"} <= set(report)
    assert {r["codec"] for r in report["results"]} == set(CODECS)
    for r in report["results"]:
        assert r["bit_exact_payload"] and r["bit_exact_decode"], r["codec"]
        assert r["encode_ms"] > 0 and r["decode_ms"] > 0 and r["compression"] > 1
