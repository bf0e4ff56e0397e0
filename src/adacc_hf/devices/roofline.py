"""What an op costs on a device this machine does not have: a roofline over its FLOPs and bytes.

A kernel's time is the larger of its arithmetic at the table's matmul or attention throughput and
its memory traffic at the table's copy bandwidth, each scaled by a calibrated efficiency, plus a
fixed launch cost; views launch nothing. The host issues every op at a fixed cost, and more per
crossing of the runtime's Python dispatch modes (`runtime.modes.crossings`), which is what makes
a small model's step host-bound. Codecs are priced from the table's measured encode / decode
times of each backend at four sizes (`table.DeviceTable.codec_ms`), the host link from its
measured copies. FLOPs: matmuls as torch's flop counter counts them; fused attention
``4 B H Sq Sk D`` forward (half of it causal), 2.5 times that backward (flash attention's
backward recomputes the probabilities: five matmuls for two).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..schema import OffloadLink
from .table import DeviceTable

__all__ = ["Roofline", "attention_flops", "kernel_seconds", "op_bytes", "op_flops"]

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
_ATTENTION_FWD = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}
_ATTENTION_BWD = {f"{n}_backward" for n in _ATTENTION_FWD}
BACKWARD_FACTOR = 2.5


def _name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def _stored_nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads of `t`: broadcast (zero-stride) dimensions read once."""
    n = math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0)
    return n * t.element_size()


def op_bytes(args: Any, kwargs: Any, out: Any) -> int:
    """Bytes an op reads (its tensor arguments) and writes (its tensor outputs)."""
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return sum(_stored_nbytes(t) for t in ins) + sum(_stored_nbytes(t) for t in outs)


def attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
    """Forward FLOPs of fused attention: ``q @ k^T`` and ``p @ v``, over the query heads."""
    *lead, sq, d = q.shape
    sk = k.shape[-2]
    flops = 4.0 * math.prod(lead) * sq * sk * d
    return flops / 2 if causal else flops


def _causal(func: Any, args: tuple, kwargs: dict) -> bool:
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "is_causal":
            return bool(kwargs.get("is_causal", args[i] if i < len(args) else False))
    return False


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[str, float]:
    """(class, FLOPs): ``"matmul"``, ``"attention"`` or ``"memory"`` (no FLOPs counted)."""
    name = _name(func)
    if name in _MATMUL:
        from torch.utils.flop_counter import flop_registry

        fn = flop_registry.get(getattr(torch.ops.aten, name))
        if fn is not None:
            return "matmul", float(fn(*args, **kwargs, out_val=out))
    if name in _ATTENTION_FWD:
        return "attention", attention_flops(args[0], args[1], _causal(func, args, kwargs))
    if name in _ATTENTION_BWD:
        flops = attention_flops(args[1], args[2], _causal(func, args, kwargs))
        return "attention", BACKWARD_FACTOR * flops
    return "memory", 0.0


def kernel_seconds(
    table: DeviceTable, eff: dict[str, float], kind: str, flops: float, nbytes: float
) -> float:
    """Seconds of one kernel of class `kind` (``matmul``, ``attention``, ``memory``) on `table`'s
    device at efficiencies `eff`."""
    memory = nbytes / (table.copy_peak_gbps * 1e9 * eff["memory"])
    if kind == "matmul":
        compute = flops / (table.matmul_tflops * 1e12 * eff["matmul"])
    elif kind == "attention":
        compute = flops / (table.matmul_tflops * 1e12 * eff["attention"])
    else:
        compute = 0.0
    return max(compute, memory) + eff["launch_us"] * 1e-6


class Roofline:
    """Prices ops, host time, codecs and the host link for one device (its `DeviceTable`)."""

    def __init__(self, table: DeviceTable, codec_speed: float | None = None) -> None:
        self.table = table
        #: a hypothetical codec speed: every codec at this fraction of a copy's bandwidth
        #: (``None``: the backends the table measured)
        self.codec_speed = codec_speed

    @property
    def label(self) -> str:
        return self.table.label

    def host_s(self, crossings: int) -> float:
        """Host seconds to issue one op crossing `crossings` runtime dispatch modes."""
        e = self.table.efficiency
        return (e["host_op_us"] + crossings * e["host_mode_us"]) * 1e-6

    def device_s(self, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        """Device seconds of one op's kernel (module docstring)."""
        kind, flops = op_flops(func, args, kwargs, out)
        return self.seconds(kind, flops, op_bytes(args, kwargs, out))

    def seconds(self, kind: str, flops: float, nbytes: float) -> float:
        """A kernel's seconds from its class, FLOPs and bytes (`op_flops`, `op_bytes`)."""
        return kernel_seconds(self.table, self.table.efficiency, kind, flops, nbytes)

    def codec_ms(
        self, codec: str, backend: str, in_nbytes: int, payload_nbytes: int
    ) -> tuple[float, float] | None:
        """(encode, decode) ms of `codec` on `backend` for an input of `in_nbytes` (None: the
        table has no figures for it); at ``codec_speed``, any codec's backend ``"modelled"``."""
        if self.codec_speed is not None:
            if backend != "modelled":
                return None
            moved = in_nbytes + payload_nbytes
            s = moved / (self.codec_speed * self.table.copy_gbps_at(in_nbytes) * 1e9)
            launch = self.table.efficiency["launch_us"] * 1e-3
            return s * 1e3 + launch, s * 1e3 + launch
        return self.table.codec_ms(codec, backend, in_nbytes)

    def link(self, host_cap_nbytes: int = 0) -> OffloadLink:
        """The host link the table measured (copies on a side stream, overlapping compute)."""
        link = self.table.link
        if not link:
            from ..errors import AdaccError

            raise AdaccError(
                f"the {self.table.name} table has no host link measured: plan it without offload"
            )
        return OffloadLink(
            d2h_gbps=link["d2h_gbps"],
            h2d_gbps=link["h2d_gbps"],
            overlap=True,
            launch_ms=link.get("launch_ms", 0.0),
            host_cap_nbytes=host_cap_nbytes,
        )

    def codec_backends(self, codec: str) -> list[str]:
        """The backends `codec_ms` can price for `codec`."""
        if self.codec_speed is not None:
            return ["modelled"]
        return sorted(self.table.codecs.get(codec, {}))
