"""Compile every kernel launch of every codec with Triton's real compiler, for GPUs this machine
need not have (``python tests/compile_kernels.py 90 80``; prints one line per failure, then
``compiled N variants; F failed``).

Runs the codecs' host code on small CPU tensors with ``_common.launch`` replaced by a recorder,
then compiles each recorded (kernel, argument types, constexprs, launch options) down to a cubin
with ``triton.compile`` (Triton's bundled ptxas): what the interpreter cannot check (globals
Triton refuses, type errors of loop-carried values, atomics, cache modifiers) fails here. Must
run without ``TRITON_INTERPRET=1``, so each launch's autotuner holds its GPU candidates: by
default the heuristic's config (the first) of every launch and the smallest and largest tiles
of each kernel's first launch are compiled; ``--all-configs`` compiles every candidate (333
variants, about 2.5 minutes on two cores).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
import triton
from adacc_kernels import (
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
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import mangle_type

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


def record_launches() -> list[Launch]:
    """(kernel, args, kwargs) of each launch of every codec's encode and decode paths."""
    seen: list[Launch] = []

    def record(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((kernel, args, kwargs))

    for module in (
        int4,
        int4_quant,
        int4_decode,
        int4_select,
        int4_channel,
        int4_outlier,
        fp8,
        bitpack,
    ):
        module.launch = record
    for module in (int4_naive, int4_asym, int4_channel, int4_outlier, fp8, bitpack):
        module.check_launchable = lambda device: None
    x = torch.randn(64, 256).to(torch.bfloat16)
    for group in (64, 3, 0):
        int4_naive.encode(x, group)
    for v in (x, x[:, :255], x.t()):
        int4_asym.encode(v)
        int4_channel.encode(v)
        fp8.encode(v)
    int4_outlier.encode(x, 64, 3.0, 8)
    int4_outlier.encode(x, 3, 3.0, 8)
    int4_outlier.encode_with_idx(x, torch.tensor([3, -1], dtype=torch.int32), 64)
    bitpack.encode((x > 0).reshape(-1))
    bitpack.encode(((x > 0).to(torch.bfloat16) * 2).reshape(-1))
    q, scale = torch.zeros(64 * 128, dtype=torch.uint8), torch.ones(64, 4)
    slot, values = torch.full((256,), -1, dtype=torch.int8), torch.zeros(64, 8, dtype=x.dtype)
    int4_decode.launch_dequant(
        q, scale, 64, 256, x.dtype, mode=2, cp=256, seg=64, slot=slot, values=values
    )
    offset = scale[:, 0].contiguous()
    int4_decode.launch_dequant(
        q[: 64 * 255 // 2 + 1], offset, 64, 255, torch.float16, mode=0, cp=255, offset=offset
    )
    bitpack.decode(torch.zeros(100, dtype=torch.uint8), torch.tensor(2.0), 800, torch.float32)
    fp8.decode(torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(64, 2), x.dtype)
    return seen


def _size(config: triton.Config) -> tuple[int, int, int]:
    return math.prod(config.kwargs.values()), config.num_warps, config.num_stages


def variants(launches: list[Launch], every_config: bool) -> list[Launch]:
    """(jit function, args, kwargs with the config's constexprs and options) per launch and
    config: all configs, or the heuristic's (the first) plus, on each kernel's first launch,
    the smallest and the largest tile."""
    out = []
    extremes_done = set()
    for kernel, args, kwargs in launches:
        if not isinstance(kernel, Autotuner):
            out.append((kernel, args, kwargs))
            continue
        picked = kernel.configs
        if not every_config:
            picked = picked[:1]
            if kernel.fn not in extremes_done:
                extremes_done.add(kernel.fn)
                picked += [min(kernel.configs, key=_size), max(kernel.configs, key=_size)]
        for cfg in dict.fromkeys(picked):
            out.append((kernel.fn, args, {**kwargs, **cfg.all_kwargs()}))
    return out


def compile_all(launches: list[Launch], archs: list[int]) -> tuple[int, list[str]]:
    """(variants compiled, failures) over the distinct launch signatures."""
    done: set[tuple[Any, ...]] = set()
    failures: list[str] = []
    for arch in archs:
        for kernel, args, kwargs in launches:
            kw = dict(kwargs)
            options = {"enable_fp_fusion": False}
            for opt, default in (("num_warps", 4), ("num_stages", 3), ("num_ctas", 1)):
                options[opt] = kw.pop(opt, default)
            for opt in ("maxnreg", "ir_override"):
                kw.pop(opt, None)
            keep = {p.name for p in kernel.params if p.do_not_specialize}
            signature, constexprs = {}, {}
            for i, name in enumerate(kernel.arg_names):
                value = kw[name] if name in kw else args[i]
                one = isinstance(value, int) and not isinstance(value, bool) and value == 1
                one = one and name not in keep
                if name in kw or one:  # Triton specialises ints equal to 1 like constexprs
                    signature[name], constexprs[name] = "constexpr", value
                else:
                    signature[name] = mangle_type(value)
            key = (
                arch,
                kernel.__name__,
                tuple(sorted(signature.items())),
                str(constexprs),
                str(sorted(options.items())),
            )
            if key in done:
                continue
            done.add(key)
            source = triton.compiler.ASTSource(
                fn=kernel, signature=signature, constexprs=constexprs
            )
            try:
                triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            except Exception as err:  # report every variant, not just the first
                cause = err.__cause__ or err
                what = f"sm_{arch} {kernel.__name__} {constexprs} {options}"
                failures.append(f"{what}: {cause}"[-600:])
    return len(done) - len(failures), failures


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: this compiles the kernels")
    every = "--all-configs" in sys.argv
    archs = [int(a) for a in sys.argv[1:] if a != "--all-configs"] or [90]
    compiled, failures = compile_all(variants(record_launches(), every), archs)
    for line in failures:
        print(line)
    print(f"compiled {compiled} variants; {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
