"""Compile every Triton kernel specialization the codecs launch, for real GPUs, on a CPU.

Run as a script in a fresh process *without* ``TRITON_INTERPRET`` (kernels defined for the
compiler, not the interpreter)::

    python tests/kernel_compile.py 90 80      # -> JSON on stdout: compiled / failed per target

Every codec's encode and decode runs on CPU tensors over shapes, dtypes and group sizes that
take each launcher branch (2-D and flat layouts, odd widths, segments wider than a register
tile, outlier fix-ups); each kernel launch is intercepted (`JITFunction.run`), its signature and
constexprs taken from the call as Triton's launcher would, and compiled ahead of time with
``triton.compile(..., target=GPUTarget("cuda", cc, 32))`` down to a cubin (ptxas ships with
triton) instead of launched. Nothing runs on a device: outputs hold whatever memory they were
given, which no launcher reads on the host (payload sizes never depend on the data). The
interpreter tests prove the arithmetic; this proves the same kernels compile for an H100 / A100.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch

_PTR = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float64: "*fp64",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}
_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "debug"}


def signature(fn: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one launch, as Triton's launcher specialises it: ints
    equal to 1 become constexprs, the others i32 (i64 past 2**31), floats fp32."""
    if hasattr(torch, "float8_e4m3fn"):
        _PTR.setdefault(torch.float8_e4m3fn, "*fp8e4nv")
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    sig, const = {}, {}
    for p in fn.params:
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[p.name], const[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v is None:
            sig[p.name], const[p.name] = "constexpr", None
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v).__name__}")
    return sig, const, options


def main(targets: list[int]) -> dict[str, Any]:
    import adacc_kernels._common as common
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from adacc_hf.codecs import dispatch, get_codec

    compiled: dict[str, set] = {str(t): set() for t in targets}
    failed: dict[str, str] = {}
    seen: set = set()

    def run(self, *args, grid, warmup, **kwargs):
        sig, const, options = signature(self, args, kwargs)
        key = (
            self.__name__,
            tuple(sorted(sig.items())),
            repr(sorted(const.items())),
            repr(options),
        )
        if key in seen:
            return None
        seen.add(key)
        name = f"{self.__name__}[{','.join(f'{k}={v}' for k, v in sorted(const.items()))}]"
        for cc in targets:
            try:
                src = ASTSource(fn=self, signature=sig, constexprs=const)
                triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
                compiled[str(cc)].add(name)
            except Exception as e:  # recorded: the test names each failure
                failed[f"sm_{cc} {name}"] = "".join(traceback.format_exception_only(e))[-2000:]
        return None

    JITFunction.run = run
    for mod in [m for n, m in sys.modules.items() if n.startswith("adacc_kernels")]:
        if hasattr(mod, "check_launchable"):
            mod.check_launchable = lambda device: None
    dispatch.use_kernel = lambda x: True
    for name, x, params in cases(common):
        codec = get_codec(name, **params)
        enc = codec.encode(x)
        codec.decode(enc)
        codec.decode(enc, out=torch.empty_like(x))
    return {
        "compiled": {k: sorted(v) for k, v in compiled.items()},
        "failed": failed,
        "launch_signatures": len(seen),
    }


def cases(common: Any):
    """(codec, input, params) covering every launcher branch."""
    shapes = [(64, 256), (5, 123), (3, 7), (33, 4100)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, cols in shapes:
            x = torch.randn(rows, cols).to(dtype)
            yield "int4_naive", x, {"group_size": 64}
            yield "int4_naive", x, {"group_size": 0}
            yield "int4_naive", x, {"group_size": 3}
            yield "int4_outlier", x, {"group_size": 64}
            yield "int4_outlier", x, {"group_size": 3}
            yield "int4_channel", x, {}
            yield "int4_asym", x, {}
            yield "fp8_e4m3", x, {}
            yield "bitpack", (x > 0).to(dtype) * 1.25, {}
        yield "bitpack", torch.rand(5, 123) > 0.5, {}
    old = common.MAX_SEGMENT_WIDTH
    common.MAX_SEGMENT_WIDTH = 64  # segments wider than a register tile: the chunked path
    try:
        x = torch.randn(9, 300)
        yield "int4_naive", x, {"group_size": 0}
        yield "int4_outlier", x, {"group_size": 300}
        yield "int4_asym", x, {}
    finally:
        common.MAX_SEGMENT_WIDTH = old


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: this compiles for GPUs")
    print(json.dumps(main([int(a) for a in sys.argv[1:]] or [90])))
