"""Codec kernels vs torch references: time, bandwidth, compression, bit-exactness.

On a GPU (default sizes 1, 16, 64, 256 MB of bf16, shape [rows, 4096])::

    python benchmarks/bench_codecs.py                  # -> benchmarks/results/codecs-<gpu>.json
    python benchmarks/bench_codecs.py --codecs int4_outlier fp8_e4m3 --sizes-mb 64

On CPU, a smoke run through Triton's interpreter (tiny sizes, wall-clock timing)::

    python benchmarks/bench_codecs.py --smoke          # = --device cpu --interpret --sizes-mb 0.0625

Per codec and size: encode / decode median time (``triton.testing.do_bench`` on GPU), achieved
GB/s counting one read of the input and one write of the payload (decode: the reverse), the ratio
to the device's copy bandwidth (``torch.empty_like(x).copy_(x)`` on the largest size, read +
write), the speed-up over the torch reference path, the compression ratio, and whether the kernel
payload and decoded tensor equal the reference's bit for bit. Target on H100/H200 for tensors
>= 16 MB: encode and decode >= 70 % of copy bandwidth and >= 5x the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

CHANNELS = 4096
DEFAULT_CODECS = ["int4_outlier", "int4_channel", "int4_asym", "int4_naive", "bitpack", "fp8_e4m3"]
TARGET_MIN_MB, TARGET_COPY_RATIO, TARGET_SPEEDUP = 16, 0.70, 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda")
    p.add_argument("--interpret", action="store_true", help="run Triton's CPU interpreter")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, few reps")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=None, help="bf16 MB per tensor")
    p.add_argument("--codecs", nargs="+", default=DEFAULT_CODECS)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--channels", type=int, default=None, help=f"last dim (default {CHANNELS})")
    p.add_argument("--reps", type=int, default=None, help="CPU timing repetitions")
    p.add_argument("--json", type=Path, default=None, help="output path (GPU default: results/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.interpret = True
        args.sizes_mb = args.sizes_mb or [1 / 16]
        args.channels = args.channels or 256
        args.reps = args.reps or 2
    args.device = args.device or "cuda"
    args.sizes_mb = args.sizes_mb or [1, 16, 64, 256]
    args.channels = args.channels or CHANNELS
    args.reps = args.reps or 5
    if args.device == "cpu" and not args.interpret:
        p.error(
            "--device cpu needs --interpret (Triton kernels run on CPU only in its interpreter)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch
    import triton

    from adacc_hf.codecs import get_codec
    from adacc_hf.codecs.dispatch import kernel_mode_override

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke (CPU interpreter) instead", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def bench(fn) -> float:
        """Median seconds per call."""
        if device.type == "cuda":
            from triton.testing import do_bench

            try:
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            except TypeError:  # older signature
                ms = do_bench(fn, warmup=25, rep=100, quantiles=[0.5])
            return float(ms[0] if isinstance(ms, (list, tuple)) else ms) / 1e3
        fn()  # warm-up (first call defines / compiles)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def make_input(name: str, numel: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(0)
        rows = max(1, numel // args.channels)
        if name == "bitpack":  # a dropout keep-mask with as many elements (bool on GPUs)
            return (torch.rand(rows, args.channels, generator=gen) >= 0.1).to(device)
        x = torch.randn(rows, args.channels, generator=gen)
        if name == "int4_outlier":  # a few hot channels, as in pretrained activations
            x[:, :: max(1, args.channels // 8)] *= 40.0
        if name == "int4_asym":  # attention probabilities
            x = torch.softmax(3 * x, dim=-1)
        return x.to(device=device, dtype=dtype)

    def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.is_floating_point and a.element_size() in (1, 2, 4):
            view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
            a, b = a.view(view), b.view(view)
        return torch.equal(a, b)

    copy_gbps: dict[float, float] = {}
    for mb in sorted(set(args.sizes_mb)):
        x = torch.randn(max(1, int(mb * 2**20) // itemsize), device=device).to(dtype)
        t = bench(lambda x=x: torch.empty_like(x).copy_(x))
        copy_gbps[mb] = 2 * x.numel() * itemsize / t / 1e9
    device_copy = copy_gbps[max(copy_gbps)]

    rows_out = []
    for name in args.codecs:
        codec = get_codec(name)
        for mb in args.sizes_mb:
            numel = int(mb * 2**20) // itemsize
            x = make_input(name, numel)
            in_bytes = x.numel() * x.element_size()
            with kernel_mode_override("torch"):
                ref = codec.encode(x)
                ref_out = codec.decode(ref)
                t_ref_enc = bench(lambda c=codec, x=x: c.encode(x))
                t_ref_dec = bench(lambda c=codec, e=ref: c.decode(e))
            with kernel_mode_override("triton"):
                enc = codec.encode(x)
                out = codec.decode(enc)
                t_enc = bench(lambda c=codec, x=x: c.encode(x))
                t_dec = bench(lambda c=codec, e=enc: c.decode(e))
            same_payload = enc.tensors.keys() == ref.tensors.keys() and all(
                equal_bits(enc.tensors[k], ref.tensors[k]) for k in enc.tensors
            )
            payload = enc.nbytes()
            row = {
                "codec": name,
                "size_mb": mb,
                "shape": list(x.shape),
                "dtype": str(x.dtype).removeprefix("torch."),
                "payload_bytes": payload,
                "compression": in_bytes / payload,
                "encode_ms": t_enc * 1e3,
                "decode_ms": t_dec * 1e3,
                "encode_gbps": (in_bytes + payload) / t_enc / 1e9,
                "decode_gbps": (in_bytes + payload) / t_dec / 1e9,
                "ref_encode_ms": t_ref_enc * 1e3,
                "ref_decode_ms": t_ref_dec * 1e3,
                "encode_speedup": t_ref_enc / t_enc,
                "decode_speedup": t_ref_dec / t_dec,
                "bit_exact_payload": same_payload,
                "bit_exact_decode": equal_bits(out, ref_out),
                "n_outliers": enc.meta.get("n_outliers"),
            }
            row["encode_copy_ratio"] = row["encode_gbps"] / device_copy
            row["decode_copy_ratio"] = row["decode_gbps"] / device_copy
            row["meets_target"] = (
                None
                if mb < TARGET_MIN_MB or device.type != "cuda"
                else min(row["encode_copy_ratio"], row["decode_copy_ratio"]) >= TARGET_COPY_RATIO
                and min(row["encode_speedup"], row["decode_speedup"]) >= TARGET_SPEEDUP
            )
            rows_out.append(row)
            del x, ref, ref_out, enc, out

    header = (
        f"{'codec':<13}{'MB':>7}{'ratio':>7}{'enc ms':>9}{'enc GB/s':>10}{'/copy':>7}{'x ref':>7}"
        f"{'dec ms':>9}{'dec GB/s':>10}{'/copy':>7}{'x ref':>7}  exact  target"
    )
    print(f"device: {_device_name(torch, device)}; copy bandwidth {device_copy:.1f} GB/s")
    print(header)
    for r in rows_out:
        exact = "yes" if r["bit_exact_payload"] and r["bit_exact_decode"] else "NO"
        target = {None: "-", True: "ok", False: "MISS"}[r["meets_target"]]
        print(
            f"{r['codec']:<13}{r['size_mb']:>7g}{r['compression']:>7.2f}"
            f"{r['encode_ms']:>9.3f}{r['encode_gbps']:>10.4g}{r['encode_copy_ratio']:>7.2f}"
            f"{r['encode_speedup']:>7.1f}{r['decode_ms']:>9.3f}{r['decode_gbps']:>10.4g}"
            f"{r['decode_copy_ratio']:>7.2f}{r['decode_speedup']:>7.1f}  {exact:<6} {target}"
        )

    report = {
        "device": _device_name(torch, device),
        "device_type": device.type,
        "interpreter": bool(args.interpret),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": [sys.executable, *sys.argv] if argv is None else ["bench_codecs.py", *argv],
        "copy_gbps": device_copy,
        "copy_gbps_by_size_mb": {str(k): v for k, v in copy_gbps.items()},
        "targets": {
            "min_size_mb": TARGET_MIN_MB,
            "copy_ratio": TARGET_COPY_RATIO,
            "speedup_vs_reference": TARGET_SPEEDUP,
        },
        "results": rows_out,
    }
    out_path = args.json
    if out_path is None and device.type == "cuda":
        slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
        out_path = Path(__file__).resolve().parent / "results" / f"codecs-{slug}.json"
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out_path}")
    return 0


def _device_name(torch, device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}), Triton interpreter"


if __name__ == "__main__":
    sys.exit(main())
