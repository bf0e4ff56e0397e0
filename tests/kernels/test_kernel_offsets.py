"""Pointer offsets past 2**31 elements, checked without allocating them.

The launchers run on ``meta`` tensors of more than 2**31 elements. A patched interpreter gives
each meta argument a region of a synthetic address space (far from real memory and from each
other), runs the corner programs of each grid (all programs of grids up to 64), checks every
active lane of every load, store and atomic against the regions, returns ``other`` for loads and
drops stores. An offset computed in int32 wraps by a multiple of 2**32 elements and lands
outside its region: the test that runs a deliberately int32 kernel shows the check catches it.
"""

from __future__ import annotations

import inspect
import itertools
import os
from unittest import mock

import numpy as np
import pytest
import torch
from kernel_support import interpreter_env  # noqa: F401 (first: the interpreter set-up)

# isort: split
import triton
import triton.language as tl
from adacc_kernels import bitpack as kbitpack
from adacc_kernels import fp8 as kfp8
from adacc_kernels import int4_asym as kasym
from adacc_kernels import int4_channel as kchannel
from adacc_kernels import int4_naive as knaive
from adacc_kernels import int4_outlier as koutlier
from adacc_kernels.int4_decode import launch_dequant
from adacc_kernels.int4_quant import SCALE_ROW, SCALE_SEGMENT
from triton.runtime import interpreter as interp

if not hasattr(interp, "interpreter_builder") or not hasattr(interp, "_implicit_cvt"):
    pytest.skip("this Triton's interpreter lacks the hooks the check uses", allow_module_level=True)

FAKE_BASE = 1 << 52  # above every user-space address
GAP = 1 << 44  # between regions: far more than any int32 wrap (2**32 elements of <= 4 bytes)
BIG = 2**31


class _FakePtr:
    """What the interpreter reads of a pointer argument."""

    def __init__(self, base: int, dtype: torch.dtype) -> None:
        self.base, self.dtype = base, dtype

    def data_ptr(self) -> int:
        return self.base


class _Memory:
    """Regions of the launches' arguments; checks and records every access."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.names: list[str] = []
        self.fake: set[int] = set()
        self.reached: dict[str, int] = {}  # region name -> highest element index touched
        self.sizes: dict[str, int] = {}
        self.next = FAKE_BASE
        self.atomics: dict[int, int] = {}
        self.kernel = ""

    def arg(self, name: str, t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        extent = 0
        if t.numel():
            extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        label = f"{self.kernel}.{name}"
        self.sizes[label] = t.element_size()
        if t.device.type != "meta":  # a real (small) tensor: its own memory
            start = t.data_ptr()
            self._add(start, start + extent * t.element_size(), label, fake=False)
            return t
        start, self.next = self.next, self.next + GAP
        self._add(start, start + extent * t.element_size(), label, fake=True)
        return _FakePtr(start, t.dtype)

    def _add(self, start: int, end: int, name: str, fake: bool) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.names.append(name)
        if fake:
            self.fake.add(start)

    def check(self, ptrs: np.ndarray, mask: np.ndarray) -> bool | None:
        """True: every active lane is in fake regions; False: in real ones; None: no lane."""
        addr = ptrs[np.broadcast_to(mask, ptrs.shape)].astype(np.uint64)
        if addr.size == 0:
            return None
        order = np.argsort(self.starts)
        starts = np.asarray(self.starts, dtype=np.uint64)[order]
        ends = np.asarray(self.ends, dtype=np.uint64)[order]
        pos = np.searchsorted(starts, addr, side="right") - 1
        inside = (pos >= 0) & (addr < ends[np.maximum(pos, 0)])
        if not inside.all():
            bad = int(addr[~inside][0])
            raise AssertionError(f"{self.kernel}: address {bad:#x} outside every argument")
        kinds = set()
        for p in np.unique(pos):
            i = int(order[p])
            name, start = self.names[i], self.starts[i]
            hit = addr[pos == p]
            top = (int(hit.max()) - start) // self.sizes[name]
            self.reached[name] = max(self.reached.get(name, 0), top)
            kinds.add(start in self.fake)
        if len(kinds) > 1:
            raise AssertionError(f"{self.kernel}: one access spans real and synthetic memory")
        return kinds.pop()


def _programs(grid: tuple[int, ...]) -> list[tuple[int, int, int]]:
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if grid[0] * grid[1] * grid[2] <= 64:
        return list(itertools.product(*(range(g) for g in grid)))
    return sorted(set(itertools.product(*({0, g - 1} for g in grid))))


@pytest.fixture
def memory(monkeypatch):
    """Launches run their corner programs against :class:`_Memory` (module doc)."""
    mem = _Memory()
    builder = interp.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw = builder.create_atomic_rmw

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        if not mem.check(ptrs.data, mask.data):
            return load(ptrs, mask, other, cache_policy, is_volatile)
        dtype_tt = ptrs.get_element_ty()
        dtype_np = interp._get_np_dtype(dtype_tt)
        fill = 0 if other is None else other.data
        data = np.broadcast_to(np.asarray(fill, dtype=dtype_np), ptrs.data.shape).copy()
        return interp.TensorHandle(data, dtype_tt)

    def masked_store(ptrs, value, mask, cache_policy):
        if not mem.check(ptrs.data, mask.data):
            return store(ptrs, value, mask, cache_policy)
        return None

    def atomic_rmw(op, ptr, val, mask, sem, scope):
        if not mem.check(ptr.data, mask.data):
            return rmw(op, ptr, val, mask, sem, scope)
        old = np.array([mem.atomics.get(int(a), 0) for a in ptr.data.reshape(-1)])
        for a, v in zip(
            ptr.data.reshape(-1), np.broadcast_to(val.data, ptr.data.shape).reshape(-1), strict=True
        ):
            mem.atomics[int(a)] = mem.atomics.get(int(a), 0) + int(v)
        return interp.TensorHandle(
            old.reshape(ptr.data.shape).astype(val.data.dtype), val.dtype.scalar
        )

    def run(kernel, *args, grid, warmup, **kwargs):
        fn = kernel.rewrite()
        mem.kernel = kernel.__name__
        spec = inspect.getfullargspec(fn)
        kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
        call = inspect.getcallargs(fn, *args, **kwargs)
        if callable(grid):  # a function of the launch's arguments (the autotuned tiles)
            grid = tuple(grid(call))
        constexprs = interp.GridExecutor(fn, kernel.arg_names, grid).constexprs
        call = {
            k: v if k in constexprs else interp._implicit_cvt(mem.arg(k, v))
            for k, v in call.items()
        }
        scope = interp._patch_lang(fn)
        try:
            full = tuple(grid) + (1,) * (3 - len(grid))
            builder.set_grid_dim(*full)
            for idx in _programs(grid):
                builder.set_grid_idx(*idx)
                fn(**call)
        finally:
            scope.restore()

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    monkeypatch.setattr(builder, "create_atomic_rmw", atomic_rmw)
    monkeypatch.setattr(interp.InterpretedFunction, "run", run)
    for module in (knaive, kasym, kchannel, koutlier, kfp8, kbitpack):
        monkeypatch.setattr(module, "check_launchable", lambda device: None)
    return mem


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _reached_past_int32(mem: _Memory, *kernels: str) -> None:
    for kernel in kernels:
        top = max((v for k, v in mem.reached.items() if k.startswith(f"{kernel}.")), default=0)
        assert top >= BIG, (kernel, top)


WIDE = (32769, 65536)  # 2**31 + 65536 elements: 513 row blocks of 64 rows, 1024 groups of 64
LONG = (2**20 + 1, 2049)  # odd channels: bytes straddle rows (flat kernels)


def test_the_check_catches_an_offset_computed_in_int32(memory):
    def copy_rows(x_ptr, y_ptr, C, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * C + cols, mask=cols < C)  # int32 row * C
        tl.store(y_ptr + row * C + cols, v, mask=cols < C)

    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        kernel = triton.jit(copy_rows)
    x = _meta(2**19 + 1, 4096)
    with pytest.raises(Exception, match="outside every argument"):
        kernel[(x.shape[0],)](x, _meta(*x.shape), x.shape[1], BLOCK=4096)


def test_int4_naive_asym_and_fp8_offsets_stay_64_bit(memory):
    x = _meta(*WIDE)
    q, scale = knaive.encode(x, 64)
    knaive.decode(q, scale, *WIDE, 64, torch.bfloat16)
    kfp8.decode(*kfp8.encode(x), torch.bfloat16)
    _reached_past_int32(memory, "_seg_encode_kernel", "_dequant2d_kernel")
    _reached_past_int32(memory, "_fp8_encode_kernel", "_fp8_decode_kernel")
    odd = _meta(*LONG)
    q, scale = knaive.encode(odd, 0)  # odd rows: statistics pass + flat quantiser
    knaive.decode(q, scale, *LONG, 0, torch.bfloat16)
    q, scale, offset = kasym.encode(odd)
    launch_dequant(q, scale, *LONG, torch.float16, mode=SCALE_ROW, cp=LONG[1], offset=offset)
    _reached_past_int32(memory, "_quant_flat_kernel", "_dequant_flat_kernel")


def test_int4_channel_and_outlier_offsets_stay_64_bit(memory):
    x = _meta(*WIDE)
    kchannel.decode(*kchannel.encode(x), *WIDE, torch.bfloat16)
    _reached_past_int32(memory, "_colpartial_kernel", "_quant2d_kernel")
    q, scale, values, _, _, slot = koutlier.encode(x, 64, 3.0, 2048)
    koutlier.decode(q, scale, values, slot, *WIDE, 64, torch.bfloat16)
    # group 3 (no padding, so the last program quantises real channels): column sums in their
    # own pass, the segment statistics, the flat quantiser
    shape = (32769, 65535)
    q, scale, values, _, _, slot = koutlier.encode(_meta(*shape), 3, 3.0, 2048)
    launch_dequant(q, scale, *shape, torch.bfloat16, mode=SCALE_SEGMENT, cp=shape[1], seg=3)
    _reached_past_int32(
        memory, "_seg_encode_kernel", "_quant_flat_kernel"
    )  # selection: per channel


def test_strided_tall_and_flat_inputs_offsets_stay_64_bit(memory):
    xt = _meta(WIDE[1], WIDE[0]).t()  # column stride 32769: cols * stride passes 2**31
    kfp8.encode(xt)
    knaive.encode(xt, 64)
    _reached_past_int32(memory, "_fp8_encode_kernel", "_seg_encode_kernel")
    tall = _meta(BIG + 3, 2)  # row indices themselves past int32
    kfp8.encode(tall)
    knaive.encode(tall, 0)
    kasym.encode(tall)
    _reached_past_int32(memory, "_fp8_encode_kernel", "_seg_encode_kernel")
    n = BIG + 8
    bits, scale, _ = kbitpack.encode(_meta(n))
    kbitpack.decode(bits, scale, n, torch.bfloat16)
    _reached_past_int32(memory, "_bitpack_encode_kernel", "_bitpack_decode_kernel")
