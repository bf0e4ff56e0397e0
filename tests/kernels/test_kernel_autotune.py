"""Every codec kernel launches through ``triton.autotune`` (``adacc_kernels._common.Tuned``).

* Under the interpreter each launch's autotuner holds exactly one config: the heuristic the
  kernels used before autotuning, recomputed here from each launch's arguments by the old
  formulas (:func:`_heuristic`), so CPU results and speed are what they were.
* Config invariance: every GPU candidate that the pruning keeps for a small shape, launched
  alone, gives the torch reference's payload and decode bit for bit. The interpreter ignores
  ``num_warps`` / ``num_stages``, so there each distinct tile runs once (on a GPU every
  config); float sums whose order a GPU's warps could change (outlier column sums, the
  selection) keep tile and warps pinned.
* For large shapes the GPU candidate lists hold the heuristic first, small (<= 1024 elements)
  and large (>= 4096) tiles for every streaming kernel, and only pipelining depths where pinned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_support import (  # first: sets up Triton's interpreter before kernels are defined
    assert_bits_equal,
    interpreter_env,  # noqa: F401 (autouse fixture)
    reference,
    with_outliers,
)

# isort: split
from adacc_kernels import (
    _common,
    bitpack,
    fp8,
    int4,
    int4_asym,
    int4_channel,
    int4_decode,
    int4_naive,
    int4_outlier,
    int4_quant,
    int4_select,
)
from triton.runtime.autotuner import Autotuner

from adacc_hf.codecs import dispatch

LAUNCHING = (int4, int4_quant, int4_decode, int4_select, int4_channel, int4_outlier, fp8, bitpack)
CODEC_MODULES = (int4_naive, int4_asym, int4_channel, int4_outlier, fp8, bitpack)
# Kernels whose tiles cover the activation (the others loop over small buffers).
STREAMING = {
    "_bitpack_encode_kernel",
    "_bitpack_decode_kernel",
    "_fp8_encode_kernel",
    "_fp8_decode_kernel",
    "_seg_encode_kernel",
    "_colpartial_kernel",
    "_quant2d_kernel",
    "_quant_flat_kernel",
    "_dequant2d_kernel",
    "_dequant_flat_kernel",
}


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4


def _heuristic(name: str, a: dict[str, Any]) -> tuple[dict[str, int], int]:
    """(tile constexprs, num_warps) the launchers chose before autotuning (their code, verbatim
    in substance), from a launch's named arguments."""
    tile, r = _common.TILE, pow2(a.get("R", 1))
    if name in ("_fp8_encode_kernel", "_fp8_decode_kernel"):
        br = max(1, min(tile // 128, r))
        return {"BLOCK_R": br, "BLOCK_C": 128}, _warps(br * 128)
    if name in ("_bitpack_encode_kernel", "_bitpack_decode_kernel"):
        block = min(pow2(a["n_bytes"]), tile // 8)
        return {"BLOCK": block}, _warps(8 * block)
    if name == "_bitpack_finish_kernel":
        return {"BLOCK_P": min(pow2(a["n_prog"]), 1024)}, 4
    if name == "_seg_encode_kernel":
        width = min(pow2(max(a["SEG"], 2)), _common.MAX_SEGMENT_WIDTH)
        br = max(1, min(tile // width, r))
        return {"BLOCK_R": br, "BLOCK_W": width}, _warps(br * width)
    if name == "_colpartial_kernel":
        bc = min(pow2(a["C"]), 128)
        br = max(1, min(tile // bc, r))
        return {"BLOCK_R": br, "BLOCK_C": bc}, _warps(br * bc)
    if name == "_colmax_scale_kernel":
        return {"BLOCK_C": min(pow2(a["C"]), 1024)}, 4
    if name == "_quant2d_kernel":
        w = min(pow2(a["C"]), 1024)
        br = max(1, min(tile // w, r))
        return {"BLOCK_R": br, "BLOCK_W": w}, _warps(br * w)
    if name == "_quant_flat_kernel":
        block = min(pow2(a["n_bytes"]), tile // 2)
        return {"BLOCK": block}, _warps(2 * block)
    if name == "_dequant2d_kernel":
        bh = min(pow2(a["CP"] // 2), 512)
        br = max(1, min(tile // (2 * bh), r))
        return {"BLOCK_R": br, "BLOCK_H": bh}, _warps(2 * br * bh)
    if name == "_dequant_flat_kernel":
        block = min(pow2(a["n_elems"]), tile)
        return {"BLOCK": block}, _warps(block)
    if name == "_select_kernel":
        bc = min(pow2(a["C"]), int4_select.SELECT_BLOCK)
        return {"BLOCK_C": bc, "BLOCK_P": min(pow2(a["nprog"]), 256)}, 8 if bc >= 1024 else 4
    if name == "_slot_kernel":
        return {"BLOCK_C": min(pow2(a["C"]), 256), "BLOCK_N": 16}, 4
    raise AssertionError(f"no heuristic known for {name}")


# -- the codec calls the tests run -------------------------------------------------------

Case = Callable[[], dict[str, torch.Tensor]]


def _codec_case(name: str, x: torch.Tensor, **params: Any) -> tuple[Case, dict[str, torch.Tensor]]:
    """(kernel-path payload + decode, the same from the torch reference)."""
    codec, ref, ref_out = reference(name, x, **params)

    def run() -> dict[str, torch.Tensor]:
        with dispatch.kernel_mode_override("triton"):
            enc = codec.encode(x)
            return {**enc.meta, **enc.tensors, "decode": codec.decode(enc)}

    return run, {**ref.meta, **ref.tensors, "decode": ref_out}


def _with_idx_case(x: torch.Tensor, group: int) -> tuple[Case, dict[str, torch.Tensor]]:
    """int4_outlier's payload for a given selection (the slot-map kernel)."""
    _, ref, _ = reference("int4_outlier", x, group_size=group)
    idx = ref.tensors["outlier_idx"]
    keys = ("q", "scale", "outlier_values", "outlier_slot")

    def run() -> dict[str, torch.Tensor]:
        return dict(zip(keys, int4_outlier.encode_with_idx(x, idx, group), strict=True))

    return run, {k: ref.tensors[k] for k in keys}


def _cases() -> list[tuple[str, Case, dict[str, torch.Tensor]]]:
    x = with_outliers((32, 256), torch.bfloat16, hot=(3, 100))
    odd = with_outliers((33, 63), torch.float16, hot=(3, 40))
    mask = (x > 0).to(torch.bfloat16) * 2
    return [
        ("fp8", *_codec_case("fp8_e4m3", x)),
        ("bitpack float", *_codec_case("bitpack", mask.reshape(-1))),
        ("bitpack bool", *_codec_case("bitpack", (x > 0).reshape(-1))),
        ("naive g32", *_codec_case("int4_naive", x, group_size=32)),
        ("naive odd", *_codec_case("int4_naive", odd)),
        ("asym", *_codec_case("int4_asym", x)),
        ("asym odd", *_codec_case("int4_asym", odd)),
        ("channel", *_codec_case("int4_channel", x)),
        ("outlier g64", *_codec_case("int4_outlier", x, group_size=64)),
        ("outlier g3", *_codec_case("int4_outlier", x[:16, :64], group_size=3)),
        ("outlier with idx", *_with_idx_case(x, 64)),
    ]


def _check(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == ref.keys(), what
    for key in ref:
        assert_bits_equal(got[key], ref[key], f"{what}: {key}")


@pytest.fixture
def launches(monkeypatch):
    """Every ``launch`` of the kernel modules: (kernel, named arguments, :func:`_heuristic`
    then)."""
    seen: list[tuple[Any, dict[str, Any], tuple[dict[str, int], int]]] = []
    real = _common.launch

    def record(kernel, grid, *args, **kwargs):
        named = {**dict(zip(kernel.arg_names, args, strict=False)), **kwargs}
        seen.append((kernel, named, _heuristic(kernel.fn.__name__, named)))
        real(kernel, grid, *args, **kwargs)

    for module in LAUNCHING:
        monkeypatch.setattr(module, "launch", record)
    return seen


@pytest.mark.skipif(not _common.INTERPRETED, reason="compiled kernels tune over GPU candidates")
def test_interpreted_launches_autotune_over_exactly_the_old_heuristic(launches, monkeypatch):
    for _, run, _ in _cases():
        run()
    monkeypatch.setattr(_common, "TILE", 64)  # several programs and row loops on small inputs
    monkeypatch.setattr(_common, "MAX_SEGMENT_WIDTH", 16)  # chunked segments
    x = with_outliers((12, 100), torch.float32)
    for name in ("int4_asym", "int4_channel", "int4_outlier", "fp8_e4m3"):
        _codec_case(name, x)[0]()
    names = set()
    for kernel, args, (tiles, warps) in launches:
        assert isinstance(kernel, Autotuner) and len(kernel.configs) == 1, kernel
        name = kernel.fn.__name__
        (cfg,) = kernel.configs
        assert (cfg.kwargs, cfg.num_warps, cfg.num_stages) == (tiles, warps, 3), (name, args)
        assert kernel.best_config is cfg
        names.add(name)
    assert names == {t.name for t in _common.ALL_TUNED}  # every kernel was launched


@pytest.fixture
def plans(monkeypatch):
    """Every (Tuned kernel, plan) the launchers ask an autotuner for."""
    seen: dict[tuple[Any, tuple[Any, ...]], None] = {}
    real = _common.Tuned.tuner

    def record(self, *plan):
        seen[(self, plan)] = None
        return real(self, *plan)

    monkeypatch.setattr(_common.Tuned, "tuner", record)
    return seen


def _to_try(configs: list[Any]) -> list[Any]:
    """Interpreted: one config per distinct tile (the interpreter ignores warps and stages);
    on a GPU every config."""
    if not _common.INTERPRETED:
        return configs
    first: dict[tuple[tuple[str, int], ...], Any] = {}
    for c in configs:
        first.setdefault(tuple(sorted(c.kwargs.items())), c)
    return list(first.values())


def _launch_alone(m: pytest.MonkeyPatch, tuned: _common.Tuned, plan: tuple, cfg: Any) -> Any:
    """Launches of ``tuned`` for ``plan`` run ``cfg`` alone (a one-config autotuner, returned)."""
    forced, real = tuned.autotuner([cfg]), tuned.tuner
    m.setattr(tuned, "tuner", lambda *p: forced if p == plan else real(*p))
    return forced


def test_every_gpu_candidate_kept_for_a_small_shape_gives_the_reference_bits(plans, monkeypatch):
    tried = 0
    for what, run, ref in _cases():
        plans.clear()
        _check(run(), ref, what)
        for tuned, plan in list(plans):
            legacy, *others = _to_try(tuned.space(*plan, interpreted=False))
            assert legacy.kwargs == tuned.space(*plan, interpreted=True)[0].kwargs
            for cfg in others:
                with monkeypatch.context() as m:
                    forced = _launch_alone(m, tuned, plan, cfg)
                    _check(run(), ref, f"{what}: {tuned.name} {cfg.kwargs}")
                assert forced.best_config is cfg  # it did launch
                tried += 1
    assert tried >= 40


def _record_large_plans(monkeypatch, plans) -> None:
    """Run every codec's host code on large meta tensors with launches dropped."""
    for module in LAUNCHING:
        monkeypatch.setattr(module, "launch", lambda *a, **k: None)
    for module in CODEC_MODULES:
        monkeypatch.setattr(module, "check_launchable", lambda device: None)
    big = torch.empty(32768, 4096, dtype=torch.bfloat16, device="meta")
    odd = torch.empty(32769, 4095, dtype=torch.bfloat16, device="meta")
    for x in (big, odd):
        for group in (0, 64, 128, 3):
            int4_naive.encode(x, group)
            int4_outlier.encode(x, group, 3.0, 128)
        int4_asym.encode(x)
        int4_channel.encode(x)
        fp8.decode(*fp8.encode(x), torch.bfloat16)
        bits, scale, _ = bitpack.encode(x.reshape(-1))
        bitpack.decode(bits, scale, x.numel(), torch.bfloat16)
    q = torch.empty(32768 * 2048, dtype=torch.uint8, device="meta")
    scale = torch.empty(32768, 64, device="meta")
    int4_decode.launch_dequant(q, scale, 32768, 4096, torch.bfloat16, mode=2, cp=4096, seg=64)
    int4_decode.launch_dequant(q, scale, 32769, 4095, torch.bfloat16, mode=0, cp=4095)
    int4_outlier.encode_with_idx(big, torch.arange(128, dtype=torch.int32), 64)


def _sums_floats(name: str, plan: tuple[Any, ...]) -> bool:
    """Plans whose float sums feed the outlier z-scores: tile and warps pinned."""
    if name == "_seg_encode_kernel":
        return plan[3]  # (rows, width, chunked, colsum, tile)
    if name == "_colpartial_kernel":
        return plan[2]  # (rows, cols, reduce_sum, tile)
    return name == "_select_kernel"


def test_gpu_candidates_for_large_shapes_span_small_and_large_tiles(plans, monkeypatch):
    _record_large_plans(monkeypatch, plans)
    small, large = set(), set()
    for tuned, plan in plans:
        gpu = tuned.space(*plan, interpreted=False)
        legacy = tuned.space(*plan, interpreted=True)
        assert len(legacy) == 1 and gpu[0] == legacy[0] and len(gpu) > 1, (tuned.name, plan)
        assert len(set(gpu)) == len(gpu)
        assert all(c.num_warps in (1, 2, 4, 8, 16) and 1 <= c.num_stages <= 3 for c in gpu)
        if _sums_floats(tuned.name, plan):
            pinned = {(tuple(c.kwargs.items()), c.num_warps) for c in gpu}
            assert len(pinned) == 1 and {c.num_stages for c in gpu} == {1, 2, 3}, tuned.name
            continue
        sizes = [tuned.elems(c) for c in gpu]
        if min(sizes) <= 1024:
            small.add(tuned.name)
        if max(sizes) >= 4096:
            large.add(tuned.name)
    assert not STREAMING - small and not STREAMING - large, (STREAMING - small, STREAMING - large)
