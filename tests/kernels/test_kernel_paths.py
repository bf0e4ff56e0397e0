"""Every kernel path under Triton's interpreter, bit for bit against the torch references: block
sizes lowered so small inputs run several row blocks, row loops in the column reductions,
several selection programs, multi-block fix-up grids and its early returns; strided inputs in
every float dtype; launches under the device guard."""

from __future__ import annotations

import pytest
import torch
from kernel_support import (  # first: sets up Triton's interpreter before kernels are defined
    DEVICE,
    FLOAT_IDS,
    FLOATS,
    assert_bits_equal,
    gen,
    interpreter_env,  # noqa: F401 (autouse fixture)
    randn,
    reference,
    with_outliers,
)

# isort: split
import triton
import triton.language as tl
from adacc_kernels import _common as kcommon
from adacc_kernels import bitpack as kbitpack
from adacc_kernels import fp8 as kfp8
from adacc_kernels import int4_asym as kasym
from adacc_kernels import int4_channel as kchannel
from adacc_kernels import int4_naive as knaive
from adacc_kernels import int4_outlier as koutlier
from adacc_kernels import int4_select
from adacc_kernels.int4 import SCALE_ROW, launch_quant, launch_seg_encode
from adacc_kernels.int4_decode import launch_dequant
from launch_count import LaunchCounter

from adacc_hf.codecs import dispatch, get_codec


@pytest.fixture
def small_blocks(monkeypatch):
    """Register tiles of 64 elements, segments of at most 16 channels in one tile, column sums
    over 2 row blocks, selection programs of 16 channels."""
    monkeypatch.setattr(kcommon, "TILE", 64)
    monkeypatch.setattr(kcommon, "MAX_SEGMENT_WIDTH", 16)
    monkeypatch.setattr(koutlier, "COLSUM_MIN_BLOCKS", 2)
    monkeypatch.setattr(koutlier, "COLSUM_PROGRAMS", 4)
    monkeypatch.setattr(kchannel, "COLMAX_MIN_BLOCKS", 2)
    monkeypatch.setattr(kchannel, "COLMAX_PROGRAMS", 2)
    monkeypatch.setattr(int4_select, "SELECT_BLOCK", 16)


def _outlier(x, group_size, fraction):
    codec = get_codec("int4_outlier", group_size=group_size, max_outlier_fraction=fraction)
    got = koutlier.encode(x, group_size, 3.0, codec.capacity(x.shape[-1]))
    _, ref, ref_out = reference(
        "int4_outlier", x, group_size=group_size, max_outlier_fraction=fraction
    )
    keys = ("q", "scale", "outlier_values", "outlier_idx", None, "outlier_slot")
    for t, key in zip(got, keys, strict=True):
        assert_bits_equal(t, ref.meta["outlier_count"] if key is None else ref.tensors[key], key)
    q, scale, values, _, _, slot = got
    out = koutlier.decode(q, scale, values, slot, *x.shape, group_size, x.dtype)
    assert_bits_equal(out, ref_out, "decode")
    return got


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_int4_outlier_small_blocks_loop_rows_and_split_every_pass(small_blocks, dtype):
    """Group 16: pass 1 over 10 row blocks of 4 rows, 5 row iterations per column-sum block;
    4 selection programs; fix-up grid 10 row blocks x 4 slots, slot 1 in the group of slot 0
    and slots 2-3 unused (both return early). Group 3: column sums in their own pass (row
    loops), then the segment statistics and the flat quantiser. Group 32 > 16: chunked."""
    x = with_outliers((37, 64), dtype, hot=(1, 4))
    _, _, values, idx, count, _ = _outlier(x, 16, 4 / 64)
    assert idx.tolist() == [1, 4, -1, -1] and count.item() == 2
    assert not values[:, 2:].any()  # unused slots: zeros written by the fix-up
    _outlier(x, 3, 4 / 64)
    _outlier(with_outliers((9, 70), dtype, hot=(5, 40, 66)), 32, 3 / 70)
    # a full buffer (3 outliers, 2 slots): the selection's bisection cut, as in the reference
    _, _, _, idx, count, _ = _outlier(with_outliers((37, 64), dtype, hot=(1, 20, 40)), 16, 2 / 64)
    assert count.item() == 3 and (idx >= 0).all()


def test_fix_up_writes_zeros_into_unused_slots_whatever_the_buffer_held(small_blocks):
    x = with_outliers((37, 64), torch.float32, hot=(1, 4))
    _, ref, _ = reference("int4_outlier", x, group_size=16, max_outlier_fraction=4 / 64)
    idx, slot = ref.tensors["outlier_idx"], ref.tensors["outlier_slot"]
    q = torch.empty(37 * 32, dtype=torch.uint8, device=DEVICE)
    scale = torch.empty(37, 4, device=DEVICE)
    launch_seg_encode(x, 16, 4, asym=False, q=q, scale=scale)
    values = torch.full((37, 4), float("nan"), device=DEVICE)
    launch_seg_encode(
        x, 16, 4, asym=False, q=q, scale=scale, slot=slot, values=values, idx=idx, fixup=True
    )
    assert_bits_equal(values, ref.tensors["outlier_values"], "values")
    assert_bits_equal(q, ref.tensors["q"], "q")


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_other_int4_codecs_small_blocks_match_reference(small_blocks, dtype):
    for shape in [(37, 64), (13, 37)]:
        x = randn(shape, dtype)
        for group in (0, 16, 3):
            _, ref, ref_out = reference("int4_naive", x, group_size=group)
            q, scale = knaive.encode(x, group)
            assert_bits_equal(q, ref.tensors["q"], f"naive q {group}")
            assert_bits_equal(knaive.decode(q, scale, *shape, group, dtype), ref_out, "naive")
        _, ref, ref_out = reference("int4_channel", x)
        q, scale = kchannel.encode(x)
        assert_bits_equal(scale, ref.tensors["scale"], "channel scale")
        assert_bits_equal(kchannel.decode(q, scale, *shape, dtype), ref_out, "channel")
        _, ref, ref_out = reference("int4_asym", x + 2)
        q, scale, offset = kasym.encode(x + 2)
        assert_bits_equal(q, ref.tensors["q"], "asym q")
        assert_bits_equal(kasym.decode(q, scale, offset, *shape, dtype), ref_out, "asym")


def _strided(x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Non-contiguous views with x's values: transposed storage, sliced channels, every
    second row."""
    rows, channels = x.shape
    wide = torch.zeros(2 * rows, channels + 5, dtype=x.dtype, device=x.device)
    wide[::2, 3 : 3 + channels] = x
    return [
        ("permuted", x.t().contiguous().t()),
        ("sliced", wide[::2, 3 : 3 + channels]),
    ]


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_strided_inputs_encode_like_their_contiguous_copies(dtype):
    for shape in [(13, 37), (12, 64)]:
        x = with_outliers(shape, dtype, hot=(2, 30))
        encoders = {
            "int4_naive": lambda v: knaive.encode(v, 16),
            "int4_naive_odd": lambda v: knaive.encode(v, 3),
            "int4_asym": kasym.encode,
            "int4_channel": kchannel.encode,
            "fp8_e4m3": kfp8.encode,
            "int4_outlier": lambda v: koutlier.encode(v, 16, 3.0, 4),
            "int4_outlier_odd": lambda v: koutlier.encode(v, 3, 3.0, 4),
        }
        for name, enc in encoders.items():
            expected = enc(x)
            for how, view in _strided(x):
                assert not view.is_contiguous() and torch.equal(view, x)
                for got, want in zip(enc(view), expected, strict=True):
                    assert_bits_equal(got, want, f"{name} {how} {shape}")


def test_every_launch_runs_under_the_device_guard_of_its_tensor(monkeypatch):
    """CPU: the guard is one shared no-op context (torch.cuda is never called); CUDA tensors
    enter torch.cuda.device of their own device; every launch goes through it (on either
    device: under ``ADACC_TEST_DEVICE=cuda`` the tensors are CUDA ones)."""
    entered: list[torch.device] = []

    class RecordingDevice:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", RecordingDevice)
    x = with_outliers((8, 64), torch.bfloat16)
    if not x.is_cuda:
        assert kcommon.device_guard(x) is kcommon.device_guard(x[:1])  # nothing built per call
    guarded: list[torch.device] = []
    real_guard = kcommon.device_guard

    def counting_guard(t):
        guarded.append(t.device)
        return real_guard(t)

    monkeypatch.setattr(kcommon, "device_guard", counting_guard)
    launches = 0
    with dispatch.kernel_mode_override("triton"):
        for name in ("int4_outlier", "int4_channel", "int4_asym", "fp8_e4m3", "bitpack"):
            codec = get_codec(name)
            with LaunchCounter() as count:
                codec.decode(codec.encode(x if name != "bitpack" else x > 0))
            launches += len(count.launches)
    assert len(guarded) == launches > 5 and set(guarded) == {x.device}
    # CPU tensors: torch.cuda.device never called; CUDA ones: entered once per launch
    assert entered == ([x.device] * launches if x.is_cuda else [])
    entered.clear()

    class CudaLike:  # what the guard reads of a CUDA tensor
        is_cuda = True
        device = torch.device("cuda", 1)

    with real_guard(CudaLike()):
        pass
    assert entered == [torch.device("cuda", 1)]


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_selection_programs_and_row_blocks_give_the_reference_selection(small_blocks, dtype):
    for seed in range(3):
        g = gen(seed)
        x = torch.randn(24, 96, generator=g) * torch.rand(96, generator=g).pow(6).mul(30).add(1)
        x = x.to(dtype).to(DEVICE)
        _, ref, _ = reference("int4_outlier", x, group_size=16)
        got = koutlier.encode(x, 16, 3.0, 3)
        assert torch.equal(got[3], ref.tensors["outlier_idx"])
        assert torch.equal(got[4], ref.meta["outlier_count"])


def test_bool_masks_over_several_programs_and_a_quantiser_with_given_offsets(small_blocks):
    """Bitpack of a bool mask over 3 programs (only program 0 writes the flags); the 2-D
    quantiser with given per-row offsets gives the asymmetric codec's codes."""
    mask = (torch.rand(150, generator=gen(2)) > 0.5).to(DEVICE)
    bits, scale, flags = kbitpack.encode(mask)
    _, ref, _ = reference("bitpack", mask)
    assert_bits_equal(bits, ref.tensors["bits"], "bits")
    assert flags.tolist() == [0, 0] and not scale
    assert_bits_equal(kbitpack.decode(bits, scale, 150, torch.bool), mask, "decode")
    x = randn((9, 64), torch.bfloat16) + 2
    _, ref, _ = reference("int4_asym", x)
    q = torch.empty(9 * 32, dtype=torch.uint8, device=DEVICE)
    scale, offset = ref.tensors["scale"], ref.tensors["offset"]
    launch_quant(x, q, scale, mode=SCALE_ROW, cp=64, offset=offset)
    assert_bits_equal(q, ref.tensors["q"], "q")


def test_launchers_reject_inputs_they_cannot_encode():
    from adacc_kernels._triton import KernelUnavailableError, check_launchable, triton_version

    assert triton_version() == __import__("triton").__version__
    with pytest.raises(KernelUnavailableError, match="CUDA tensors only"):
        check_launchable(torch.device("meta"))
    x = randn((4, 8), torch.float32)
    q = torch.empty(16, dtype=torch.uint8, device=DEVICE)
    scale = torch.empty(4, 1, device=DEVICE)
    with pytest.raises(ValueError, match="rows, channels"):
        knaive.encode(x.reshape(-1), 0)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        knaive.encode(x.to(torch.float64), 0)
    with pytest.raises(ValueError, match="flat contiguous"):
        kbitpack.encode(x > 0)
    with pytest.raises(ValueError, match="even segment"):
        launch_seg_encode(x, 3, 3, asym=False, q=q, scale=scale)
    with pytest.raises(ValueError, match="outlier buffer idx"):
        launch_seg_encode(x, 8, 1, asym=False, scale=scale, values=x.new_empty(4, 1))
    with pytest.raises(ValueError, match="one register tile"):
        launch_seg_encode(
            randn((4, 5000), torch.float32), 5000, 1, asym=False, scale=scale, colsum_rows=2
        )
    with pytest.raises(ValueError, match="contiguous"):
        launch_dequant(q, scale, 4, 8, torch.float32, mode=SCALE_ROW, cp=8, out=x.t())


def test_float32_to_bfloat16_rounds_as_torch_and_keeps_every_nan_a_nan():
    """Round to nearest even as torch does, inf stays inf, and NaNs of any payload stay NaN: a
    GPU computes NaN as 0x7FFFFFFF, whose rounded bits used to carry into the sign (-0.0)."""

    @triton.jit  # defined here: the interpreter is on while a kernel test runs
    def to_bf16(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, kcommon.f32_to_bf16_bits(tl.load(x_ptr + offs)))

    words = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFF800000, 0x7F800000]
    words += [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80000000]
    bits32 = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    x = torch.cat([bits32.view(torch.float32), torch.randn(116, generator=gen(0)) * 1e3])
    x = x.to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.int16, device=DEVICE)
    kcommon.launch(to_bf16, (1,), x, out, N=x.numel())
    got = out.view(torch.bfloat16)
    assert_bits_equal(got, x.to(torch.bfloat16), "f32 -> bf16")
    assert torch.equal(torch.isnan(got), torch.isnan(x))
