"""What one codec call costs on the host: Triton launches and aten ops per encode / decode,
environment reads and imports in the dispatch glue, and ``int4_outlier``'s one-launch channel
selection against the torch rule it implements."""

from __future__ import annotations

import builtins
import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from kernel_support import (  # first: sets up Triton's interpreter before kernels are defined
    DEVICE,
    gen,
    interpreter_env,  # noqa: F401 (autouse fixture)
    with_outliers,
)

# isort: split
from adacc_kernels import _common as kcommon
from adacc_kernels import int4_select
from adacc_kernels.int4 import launch_colpartial
from adacc_kernels.selection import pick_outliers, slot_dtype
from launch_count import LaunchCounter

from adacc_hf.codecs import dispatch, get_codec
from adacc_hf.codecs.int4_outlier import channel_slots, channel_zscores

SEG, SELECT, FIX = "_seg_encode_kernel", "_select_kernel", "_seg_encode_kernel"
DEQ = ["_dequant2d_kernel"]
# (codec, params, input kind) -> (encode launches, encode allocations, decode launches); odd
# int4 groups add the flat quantiser's pass to the fused encoder's statistics pass
PINNED = [
    # workspace, column sums, q, scale, idx, count, slot map, values
    ("int4_outlier", {}, "act", [SEG, SELECT, FIX], 8, DEQ),
    (
        "int4_outlier",
        {"group_size": 3},
        "act",
        ["_colpartial_kernel", SELECT, "_seg_encode_kernel", "_quant_flat_kernel"],
        8,
        DEQ,
    ),
    ("int4_naive", {}, "act", [SEG], 2, DEQ),
    ("int4_naive", {"group_size": 32}, "act", [SEG], 2, DEQ),
    (
        "int4_channel",
        {},
        "act",
        ["_colpartial_kernel", "_colmax_scale_kernel", "_quant2d_kernel"],
        3,
        DEQ,
    ),
    ("int4_asym", {}, "act", [SEG], 3, DEQ),
    ("fp8_e4m3", {}, "act", ["_fp8_encode_kernel"], 2, ["_fp8_decode_kernel"]),
    (
        "bitpack",
        {},
        "float_mask",
        ["_bitpack_encode_kernel", "_bitpack_finish_kernel"],
        4,
        ["_bitpack_decode_kernel"],
    ),
    ("bitpack", {}, "bool_mask", ["_bitpack_encode_kernel"], 4, ["_bitpack_decode_kernel"]),
]


def _input(kind: str) -> torch.Tensor:
    x = with_outliers((64, 256), torch.bfloat16, hot=(3, 100))
    if kind == "float_mask":
        return (x > 0).to(torch.bfloat16) * 2
    return x > 0 if kind == "bool_mask" else x


@pytest.mark.parametrize(
    ("name", "params", "kind", "enc_launches", "allocs", "dec_launches"), PINNED
)
def test_each_codec_call_launches_a_pinned_set_of_kernels_and_no_torch_compute(
    name, params, kind, enc_launches, allocs, dec_launches
):
    """Before this pin, int4_outlier encode ran 4 launches plus 14 aten compute ops (gt, sum,
    where, topk, sort, lt, a copy, a zeros fill...) and its decode 2 launches; a float bitpack
    encode 1 launch plus 19 aten compute ops, a bool one 1 launch plus 2 zeros fills."""
    codec, x = get_codec(name, **params), _input(kind)
    with dispatch.kernel_mode_override("triton"):
        codec.decode(codec.encode(x))  # first calls resolve the mode and import the kernels
        with LaunchCounter() as enc_count:
            enc = codec.encode(x)
        with LaunchCounter() as dec_count:
            codec.decode(enc)
    assert enc_count.launches == enc_launches
    assert dec_count.launches == dec_launches
    assert enc_count.device_ops == Counter() and dec_count.device_ops == Counter()
    assert enc_count.aten["empty"] + enc_count.aten["new_empty"] == allocs
    assert dec_count.aten["empty"] + dec_count.aten["new_empty"] == 1  # the output


class _RecordingEnviron(dict):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def get(self, key, default=None):
        self.seen.append(key)
        return default

    def __getitem__(self, key):
        self.seen.append(key)
        raise KeyError(key)


def test_codec_calls_read_no_environment_and_import_nothing_in_the_dispatch_glue(monkeypatch):
    env_reads: list[str] = []
    imports: list[str] = []
    real_import = builtins.__import__

    def recording_import(name, globals=None, *args, **kwargs):
        if globals and globals.get("__name__") == dispatch.__name__:
            imports.append(name)
        return real_import(name, globals, *args, **kwargs)

    fake_os = type(sys)("os")
    fake_os.environ = _RecordingEnviron(env_reads)
    x = with_outliers((8, 64), torch.float32)
    auto = x.is_cuda  # "auto" runs the kernels on CUDA (this suite needs triton there)
    for mode in ("triton", "torch", None):
        dispatch.set_kernel_mode(mode)
        try:
            for name in ("int4_outlier", "fp8_e4m3"):
                codec = get_codec(name)
                codec.decode(codec.encode(x))  # resolves the mode once
                with monkeypatch.context() as m:
                    m.setattr(dispatch, "os", fake_os)
                    m.setattr(builtins, "__import__", recording_import)
                    for _ in range(2):
                        codec.decode(codec.encode(x))
                        assert dispatch.use_kernel(x) == (
                            mode == "triton" or (mode, auto) == (None, True)
                        )
        finally:
            dispatch.set_kernel_mode(None)
    assert env_reads == [] and imports == []
    dispatch.refresh_kernel_mode()  # the next resolution reads $ADACC_KERNELS again
    with monkeypatch.context() as m:
        m.setattr(dispatch, "os", fake_os)
        assert dispatch.kernel_mode() == "auto" and dispatch.kernel_mode() == "auto"
    assert env_reads == [dispatch.ENV_VAR]


# -- int4_outlier's selection kernel -----------------------------------------------------


def _select(x: torch.Tensor, threshold: float, capacity: int):
    """(idx, count, slot, z) of the selection kernel on x's column sums (z from its keys)."""
    ws, counter = int4_select.workspace(x.shape[1], x.device)
    part = launch_colpartial(x, reduce_sum=True, target_blocks=4, counter=counter)
    idx, count, slot = int4_select.launch_select(
        part, ws, threshold, capacity, slot_dtype(capacity)
    )
    key = ws[: x.shape[1]]
    z = (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)  # order keys back to floats
    return idx, count, slot, z, part


def test_selection_kernel_follows_the_reference_rule_over_several_programs(monkeypatch):
    """Several selection programs (16 channels each) and row blocks; a full buffer whose cut
    falls inside a group of equal z-scores (the lower channels win, as in the reference)."""
    monkeypatch.setattr(int4_select, "SELECT_BLOCK", 16)
    monkeypatch.setattr(kcommon, "TILE", 256)  # 6 row blocks (of 2 rows) in the column sums
    x = torch.randn(12, 200, generator=gen(5))
    x[:, [7, 30, 95]] *= torch.tensor([14.0, 16.0, 18.0])
    x[:, [50, 51, 52, 70]] = 12 * x[:, 3:4].abs().mean()  # four equal columns: equal z-scores
    x = x.to(DEVICE)
    ref_z = channel_zscores(x)
    for capacity, expected in [
        (5, [7, 30, 50, 51, 95]),  # 7 above the threshold: two of the four ties fit
        (10, [7, 30, 50, 51, 52, 70, 95, -1, -1, -1]),
        (2, [30, 95]),
    ]:
        idx, count, slot, z, part = _select(x, 3.0, capacity)
        assert part.shape[0] > 1 and count.item() == 7 and idx.tolist() == expected
        ref_idx, ref_count = pick_outliers(z, 3.0, capacity)  # the torch rule on these z
        assert torch.equal(idx, ref_idx) and torch.equal(count, ref_count)
        assert torch.equal(slot, channel_slots(idx, 200))
        torch.testing.assert_close(z, ref_z, rtol=1e-5, atol=1e-5)
        again = _select(x, 3.0, capacity)
        assert all(
            torch.equal(a, b) for a, b in zip(again, (idx, count, slot, z, part), strict=True)
        )


def test_selection_kernel_selects_nothing_without_spread_or_outliers(monkeypatch):
    monkeypatch.setattr(int4_select, "SELECT_BLOCK", 16)
    for x in (torch.ones(4, 40), torch.randn(4, 40, generator=gen(1))):
        idx, count, slot, z, _ = _select(x.to(DEVICE), 3.0, 3)
        assert idx.tolist() == [-1, -1, -1] and count.item() == 0
        assert slot.tolist() == [-1] * 40 and slot.dtype == torch.int8
    assert (
        torch.isneginf(z).sum() == 0
        and torch.isneginf(_select(torch.ones(2, 40, device=DEVICE), 3.0, 3)[3]).all()
    )


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="no CUDA backend in triton"
)
def test_every_kernel_launch_compiles_with_tritons_compiler_for_sm_90(tmp_path):
    """The interpreter runs kernels as Python; this compiles each launch of every codec down to
    a cubin (Triton's bundled ptxas, no GPU), in a process without TRITON_INTERPRET and with an
    empty cache (it found ``FLT_MIN: tl.constexpr = ...`` globals, which Triton 3.9 rejects)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    script = Path(__file__).resolve().parents[1] / "compile_kernels.py"
    res = subprocess.run(
        [sys.executable, str(script), "90"], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0 and res.stdout.rstrip().endswith("; 0 failed"), (
        res.stdout[-3000:] + res.stderr[-3000:]
    )
