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
import os
import platform
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

CHANNELS = 4096
DEFAULT_CODECS = ["int4_outlier", "int4_channel", "int4_asym", "int4_naive", "bitpack", "fp8_e4m3"]


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

    from benchmarks.harness import codecs
    from benchmarks.harness.env import device_name, device_tag
    from benchmarks.harness.report import write_json

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke (CPU interpreter) instead", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    copy_gbps = codecs.copy_bandwidth(args.sizes_mb, device, dtype, args.reps)
    device_copy = copy_gbps[max(copy_gbps)]
    rows = [
        codecs.bench_codec(
            name, mb, device, dtype, channels=args.channels, reps=args.reps, device_copy=device_copy
        )
        for name in args.codecs
        for mb in args.sizes_mb
    ]
    where = device_name(device) + ("" if device.type == "cuda" else ", Triton interpreter")
    print(f"device: {where}; copy bandwidth {device_copy:.1f} GB/s")
    print_table(rows)
    report = {
        "device": where,
        "device_type": device.type,
        "interpreter": bool(args.interpret),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": [sys.executable, *sys.argv] if argv is None else ["bench_codecs.py", *argv],
        "copy_gbps": device_copy,
        "copy_gbps_by_size_mb": {str(k): v for k, v in copy_gbps.items()},
        "targets": {
            "min_size_mb": codecs.TARGET_MIN_MB,
            "copy_ratio": codecs.TARGET_COPY_RATIO,
            "speedup_vs_reference": codecs.TARGET_SPEEDUP,
        },
        "results": rows,
    }
    out_path = args.json
    if out_path is None and device.type == "cuda":
        results = Path(__file__).resolve().parent / "results"
        out_path = results / f"codecs-{device_tag(device)}.json"
    if out_path is not None:
        write_json(out_path, report, indent=2, sort_keys=True)
        print(f"wrote {out_path}")
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'codec':<13}{'MB':>7}{'ratio':>7}{'enc ms':>9}{'enc GB/s':>10}{'/copy':>7}{'x ref':>7}"
        f"{'dec ms':>9}{'dec GB/s':>10}{'/copy':>7}{'x ref':>7}  exact  target"
    )
    for r in rows:
        exact = "yes" if r["bit_exact_payload"] and r["bit_exact_decode"] else "NO"
        target = {None: "-", True: "ok", False: "MISS"}[r["meets_target"]]
        print(
            f"{r['codec']:<13}{r['size_mb']:>7g}{r['compression']:>7.2f}"
            f"{r['encode_ms']:>9.3f}{r['encode_gbps']:>10.4g}{r['encode_copy_ratio']:>7.2f}"
            f"{r['encode_speedup']:>7.1f}{r['decode_ms']:>9.3f}{r['decode_gbps']:>10.4g}"
            f"{r['decode_copy_ratio']:>7.2f}{r['decode_speedup']:>7.1f}  {exact:<6} {target}"
        )


if __name__ == "__main__":
    sys.exit(main())
