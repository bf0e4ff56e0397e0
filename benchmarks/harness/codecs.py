"""Codec kernels against their torch references: inputs like training's, timing, bit-exactness.

`bench_codec` encodes and decodes one input with the torch reference path and with the Triton
kernels (`adacc_hf.codecs.dispatch.kernel_mode_override`), times both (`median_s`: Triton's
``do_bench`` on CUDA, `adacc_hf.runtime.timing.time_call` elsewhere) and checks the kernel's
payload and decoded tensor bit for bit. Importing this module loads no kernel: set
``TRITON_INTERPRET=1`` first to run them on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from adacc_hf.codecs import get_codec
from adacc_hf.codecs.dispatch import kernel_mode_override
from adacc_hf.runtime.timing import time_call

TARGET_MIN_MB, TARGET_COPY_RATIO, TARGET_SPEEDUP = 16, 0.70, 5.0


def median_s(fn, device, reps: int) -> float:
    """Median seconds per call: ``triton.testing.do_bench`` on CUDA; elsewhere one warm-up call
    (it defines / compiles), then `adacc_hf.runtime.timing.time_call`."""
    if device.type == "cuda":
        from triton.testing import do_bench

        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except TypeError:  # older signature
            ms = do_bench(fn, warmup=25, rep=100, quantiles=[0.5])
        return float(ms[0] if isinstance(ms, (list, tuple)) else ms) / 1e3
    fn()
    return time_call(fn, device, reps) / 1e3


def copy_bandwidth(sizes_mb: list[float], device, dtype, reps: int) -> dict[float, float]:
    """GB/s of ``torch.empty_like(x).copy_(x)`` (read + write) per size."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for mb in sorted(set(sizes_mb)):
        x = torch.randn(max(1, int(mb * 2**20) // itemsize), device=device).to(dtype)
        t = median_s(lambda x=x: torch.empty_like(x).copy_(x), device, reps)
        out[mb] = 2 * x.numel() * itemsize / t / 1e9
    return out


def make_input(name: str, numel: int, channels: int, device, dtype) -> torch.Tensor:
    """A tensor like the ones `name` encodes in training: a dropout keep-mask for bitpack, a few
    hot channels for int4_outlier, attention probabilities for int4_asym, else Gaussian."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = max(1, numel // channels)
    if name == "bitpack":  # a dropout keep-mask with as many elements (bool on GPUs)
        return (torch.rand(rows, channels, generator=gen) >= 0.1).to(device)
    x = torch.randn(rows, channels, generator=gen)
    if name == "int4_outlier":  # a few hot channels, as in pretrained activations
        x[:, :: max(1, channels // 8)] *= 40.0
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


def bench_codec(
    name: str, mb: float, device, dtype, *, channels: int, reps: int, device_copy: float
) -> dict[str, Any]:
    """One codec at one size: the torch reference and the Triton kernel side by side."""
    codec = get_codec(name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    x = make_input(name, int(mb * 2**20) // itemsize, channels, device, dtype)
    in_bytes = x.numel() * x.element_size()
    timed = {}
    for mode in ("torch", "triton"):
        with kernel_mode_override(mode):
            enc = codec.encode(x)
            timed[mode] = (
                enc,
                codec.decode(enc),
                median_s(lambda: codec.encode(x), device, reps),
                median_s(lambda e=enc: codec.decode(e), device, reps),
            )
    ref, ref_out, t_ref_enc, t_ref_dec = timed["torch"]
    enc, out, t_enc, t_dec = timed["triton"]
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
    return row


def bench_backends(
    name: str,
    mb: float,
    device,
    dtype,
    *,
    channels: int,
    reps: int,
    device_copy: float,
    backends: list[str] | None = None,
) -> list[dict[str, Any]]:
    """One codec at one size on each of its backends that runs on `device` (`backends`: a
    subset), against the torch reference's payload and decode, bit for bit; one row per backend
    with its GB/s and ratio to a copy."""
    from adacc_hf.codecs import backends as be
    from adacc_hf.codecs.backends import same_bits

    ref = get_codec(name, backend="torch")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    x = make_input(name, int(mb * 2**20) // itemsize, channels, device, dtype)
    want = ref.encode(x)
    want_out = ref.decode(want)
    in_bytes = x.numel() * x.element_size()
    rows = []
    for b in backends or be.backends_of(name):
        why = be.unavailable(name, b, x.device)
        if why is not None:
            rows.append({"codec": name, "backend": b, "size_mb": mb, "unavailable": why})
            continue
        codec = get_codec(name, backend=b)
        enc = codec.encode(x)  # compiles / tunes where the backend does
        out = codec.decode(want)
        t_enc = median_s(lambda c=codec: c.encode(x), device, reps)
        t_dec = median_s(lambda c=codec: c.decode(want), device, reps)
        moved = in_bytes + enc.nbytes()
        row = {
            "codec": name,
            "backend": b,
            "size_mb": mb,
            "shape": list(x.shape),
            "dtype": str(x.dtype).removeprefix("torch."),
            "payload_bytes": enc.nbytes(),
            "compression": in_bytes / enc.nbytes(),
            "encode_ms": t_enc * 1e3,
            "decode_ms": t_dec * 1e3,
            "encode_gbps": moved / t_enc / 1e9,
            "decode_gbps": moved / t_dec / 1e9,
            "bit_exact_payload": enc.tensors.keys() == want.tensors.keys()
            and all(same_bits(enc.tensors[k], want.tensors[k]) for k in enc.tensors),
            "bit_exact_decode": same_bits(out, want_out),
        }
        row["encode_copy_ratio"] = row["encode_gbps"] / device_copy
        row["decode_copy_ratio"] = row["decode_gbps"] / device_copy
        rows.append(row)
    return rows
