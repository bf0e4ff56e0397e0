"""The profiler: one block of each group measured on the real device and micro-batch.

`profile_model(model, sample_batch)` returns a `Profile`: per op its forward time, output bytes and,
for each codec that applies, the encoded bytes, encode + decode time and error measured on the real
activation; per block group the bytes a checkpointed block always holds (its input), the
no-checkpoint bytes, the fixed recompute cost, and the transient memory of one block's backward;
plus the activations held outside the blocks. The solver turns a Profile and a budget into a Policy.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import __version__
from .adapters import CODEC_FOR_LAYER, get_adapter
from .adapters.registry import _base_model
from .codecs import Codec, get_codec
from .policy import MIN_COMPRESS_CHANNELS, MIN_COMPRESS_NUMEL, GroupPolicy, OpSpec, Policy, Variant
from .runtime.ops import storage_id, tensor_outputs
from .runtime.trace import (
    _devices,
    _model_kwargs,
    first_tensor_nbytes,
    record_block,
    run_representatives,
    train_mode,
)

PROFILE_FORMAT = 1


@dataclass
class CodecProfile:
    """One codec measured on one op's real output."""

    codec: str
    params: dict[str, Any]
    nbytes: int  # encoded bytes (exact, on the profiled activation)
    encode_ms: float
    decode_ms: float
    rel_error: float  # ||x - decode(encode(x))|| / ||x||
    n_outliers: int = 0

    @property
    def ms(self) -> float:
        return self.encode_ms + self.decode_ms


@dataclass
class OpProfile:
    """One op of a block (see `adacc_hf.policy.OpSpec`) with its measured costs."""

    key: str
    layer_type: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # raw output bytes (the cost of retaining it)
    saved: bool
    cacheable: bool
    fwd_ms: float  # time to (re)compute it
    block_output: bool = False  # an output of this op is the block's output
    codecs: dict[str, CodecProfile] = field(default_factory=dict)
    shared_nbytes: int = 0  # bytes of its outputs held anyway (by the next block, as its input)

    @property
    def retain_nbytes(self) -> int:
        return self.nbytes - self.shared_nbytes


@dataclass
class GroupProfile:
    """A block group: its ops and what a block costs as a whole."""

    name: str
    num_blocks: int
    input_nbytes: int  # held by a checkpointed block whatever the policy (measured)
    full_nbytes: int  # held by a block with no checkpointing (measured)
    fixed_ms: float  # recompute time of ops that always rerun in a checkpointed block
    transient_nbytes: int  # extra peak during one checkpointed block's backward
    block_fwd_ms: float  # one block's forward, no checkpointing
    ops: list[OpProfile] = field(default_factory=list)


@dataclass
class Profile:
    """Everything the solver needs, measured on one device, dtype and micro-batch shape."""

    model_type: str
    adapter: str
    adapter_version: int
    device: str
    dtype: str
    batch_shape: dict[str, list[int]]
    groups: dict[str, GroupProfile]
    nonblock_nbytes: int  # activations held outside the blocks (embeddings, logits, loss...)
    nonblock_transient_nbytes: int = 0  # backward temporary outside the blocks (logits grad)
    profile_ms: float = 0.0  # wall time spent profiling
    library_version: str = __version__
    format_version: int = PROFILE_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        groups = {}
        for name, g in d.pop("groups").items():
            ops = []
            for o in g.pop("ops"):
                codecs = {k: CodecProfile(**c) for k, c in o.pop("codecs").items()}
                ops.append(OpProfile(**{**o, "shape": tuple(o["shape"])}, codecs=codecs))
            groups[name] = GroupProfile(**g, ops=ops)
        return cls(**d, groups=groups)

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups.values())

    def no_checkpoint_nbytes(self) -> int:
        """Activation bytes held with no checkpointing anywhere."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.full_nbytes for g in self.groups.values()
        )

    def full_recompute_nbytes(self) -> int:
        """Activation bytes held under full recomputation (the smallest any policy holds)."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.input_nbytes for g in self.groups.values()
        )


# --------------------------------------------------------------------------- measuring


def _cpu_timer(func, args, kwargs):
    t0 = time.perf_counter()
    out = func(*args, **kwargs)
    return out, (time.perf_counter() - t0) * 1e3


def _cuda_timer(func, args, kwargs):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = func(*args, **kwargs)
    end.record()
    return out, (start, end)


def _ms(elapsed: Any) -> float:
    if isinstance(elapsed, tuple):
        return elapsed[0].elapsed_time(elapsed[1])
    return float(elapsed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_call(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall time of `fn()` in ms (synchronised on CUDA)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def candidate_codecs(
    op: OpSpec,
    allowed: Iterable[str] | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Codec]:
    """Codecs worth profiling for an op: its layer type's codec (bit-packing for bool masks),
    or every allowed codec that accepts the dtype when `allowed` is given."""
    if op.dtype == "torch.bool":
        names = ["bitpack"]
    elif op.dtype not in ("torch.float32", "torch.float16", "torch.bfloat16"):
        return []
    elif allowed is None:
        names = [CODEC_FOR_LAYER.get(op.layer_type, "int4_outlier")]
    else:
        names = [n for n in allowed if n != "bitpack"]
    numel = math.prod(op.shape) if op.shape else 1
    if op.dtype != "torch.bool" and (
        not op.shape or op.shape[-1] < MIN_COMPRESS_CHANNELS or numel < MIN_COMPRESS_NUMEL
    ):
        return []
    params = params or {}
    return [get_codec(n, **dict(params.get(n, {}))) for n in names]


def profile_codec(
    codec: Codec, x: torch.Tensor, device: torch.device, repeats: int = 3
) -> CodecProfile | None:
    """Encode/decode time, exact encoded size and error of `codec` on the real tensor `x`.

    None when the codec cannot encode `x` (non-finite values, e.g. -inf masked scores).
    """
    if not codec.applicable(x):
        return None
    x = x.detach()
    enc = codec.encode(x)
    if not all(
        bool(torch.isfinite(t).all()) for t in enc.tensors.values() if t.is_floating_point()
    ):
        return None
    dec = codec.decode(enc)
    xf = x.float()
    denom = float(xf.norm()) or 1.0
    err = float((dec.float() - xf).norm()) / denom
    if not math.isfinite(err):
        return None
    return CodecProfile(
        codec=codec.name,
        params=codec.params(),
        nbytes=enc.nbytes(),
        encode_ms=_time_call(lambda: codec.encode(x), device, repeats),
        decode_ms=_time_call(lambda: codec.decode(enc), device, repeats),
        rel_error=err,
        n_outliers=int(enc.meta.get("n_outliers", 0)),
    )


def _storages(out: Any) -> set[int]:
    return {storage_id(t) for t in tensor_outputs(out) if t.numel()}


def profile_model(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    *,
    codecs: Iterable[str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
    repeats: int = 5,
    warmup: int = 1,
) -> Profile:
    """Measure one block of each group on the model's device with the real micro-batch.

    Runs under full recomputation (plus one block at a time without it), so it fits wherever full
    recomputation fits. `codecs` widens the codecs profiled per op (default: the layer type's own
    codec), `codec_params` sets their parameters (e.g. the outlier z-score threshold); `repeats`
    timed runs after `warmup` give medians.
    """
    t_start = time.perf_counter()
    adapter = get_adapter(model)
    base = _base_model(model)
    device = next(base.parameters()).device
    handle = base.__dict__.get("_adacc_handle")
    active = handle.policy if handle is not None and handle.active else None
    if active is not None:
        handle.remove()
    allowed = list(codecs) if codecs is not None else None
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    measured: dict[str, dict[str, Any]] = {}

    def visit(adapter, group, block, fn, args):
        for _ in range(warmup):
            fn(*args)
        runs = []
        for _ in range(repeats):
            out, rec, ops = record_block(adapter, group, block, fn, args, timer=timer)
            runs.append(rec)
        _sync(device)
        keys = [op.key for op in ops]
        fwd = {
            k: statistics.median(_ms(r.recs[i].elapsed) for r in runs) for i, k in enumerate(keys)
        }
        other = statistics.median(sum(_ms(e) for e in r.other_ms) for r in runs)
        block_ms = _time_call(lambda: fn(*args), device, max(1, repeats // 2))
        outs = _storages(out)
        last = runs[-1]
        op_profiles = []
        for op, raw in zip(ops, last.outputs, strict=True):
            tensors = tensor_outputs(raw)
            prof = OpProfile(
                key=op.key,
                layer_type=op.layer_type,
                shape=op.shape,
                dtype=op.dtype,
                nbytes=op.nbytes,
                saved=op.saved,
                cacheable=op.cacheable,
                fwd_ms=fwd[op.key],
                block_output=bool(_storages(raw) & outs),
                shared_nbytes=sum(
                    t.numel() * t.element_size()
                    for t in tensors
                    if t.numel() and storage_id(t) in outs
                ),
            )
            if op.cacheable and tensors:
                for codec in candidate_codecs(op, allowed, codec_params):
                    cp = profile_codec(codec, tensors[0], device)
                    if cp is not None:
                        prof.codecs[codec.name] = cp
            op_profiles.append(prof)
        measured[group.name] = {
            "ops": op_profiles,
            "fixed_ms": other + sum(p.fwd_ms for p in op_profiles if not p.cacheable),
            "block_fwd_ms": block_ms,
            "input_guess": first_tensor_nbytes(args),
        }
        del runs, last
        return out

    try:
        run_representatives(base, sample_batch, visit)
        groups = adapter.block_groups(base)
        specs = {
            g.name: [
                OpSpec(o.key, o.layer_type, o.shape, o.dtype, o.nbytes, o.saved, o.cacheable)
                for o in measured[g.name]["ops"]
            ]
            for g in groups
        }
        full, held = _block_memory(base, sample_batch, groups, specs)
    finally:
        if active is not None:
            handle.set_policy(active)

    gprofs = {}
    for g in groups:
        m = measured[g.name]
        input_nbytes = held.blocks_mean[g.name]
        largest = max((o.nbytes for o in m["ops"]), default=0)
        gprofs[g.name] = GroupProfile(
            name=g.name,
            num_blocks=len(g.modules),
            input_nbytes=input_nbytes,
            full_nbytes=full[g.name],
            fixed_ms=m["fixed_ms"],
            # recomputing one block materialises what it would hold without checkpointing, plus
            # one backward temporary as large as its largest activation
            transient_nbytes=max(0, full[g.name] - input_nbytes) + largest,
            block_fwd_ms=m["block_fwd_ms"],
            ops=m["ops"],
        )
    shapes = {k: list(v.shape) for k, v in sample_batch.items() if isinstance(v, torch.Tensor)}
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    dev_name = str(device)
    if device.type == "cuda":
        dev_name += f" ({torch.cuda.get_device_name(device)})"
    return Profile(
        model_type=base.config.model_type,
        adapter=adapter.name,
        adapter_version=adapter.version,
        device=dev_name,
        dtype=str(dtype),
        batch_shape=shapes,
        groups=gprofs,
        nonblock_nbytes=held.other,
        nonblock_transient_nbytes=held.largest_other,
        profile_ms=(time.perf_counter() - t_start) * 1e3,
    )


@dataclass
class _Held:
    blocks_mean: dict[str, int]
    other: int
    largest_other: int


def _block_memory(base, batch, groups, specs) -> tuple[dict[str, int], _Held]:
    """Measured bytes held per block and outside the blocks.

    Full recomputation everywhere gives what a checkpointed block holds (its input, and tensors
    like T5's position bias that later blocks read); then each group's first block in turn runs
    without checkpointing while every other block is checkpointed. Measuring each plain block next
    to checkpointed ones is the conservative case: a plain neighbour would save some of the same
    tensors.
    """
    from .runtime import apply_adacc
    from .runtime.memory import activation_memory_report

    adapter = get_adapter(base)

    def policy(plain: str | None) -> Policy:
        gps = {}
        for g in groups:
            n = len(g.modules)
            if g.name == plain:
                variants = [Variant(1, False), Variant(n - 1, True, {})]
            else:
                variants = [Variant(n, True, {})]
            gps[g.name] = GroupPolicy(ops=specs[g.name], variants=variants)
        return Policy(
            base.config.model_type,
            adapter.name,
            gps,
            {"source": "profiler"},
            adapter_version=adapter.version,
        )

    full = {}
    with train_mode(base), torch.random.fork_rng(devices=_devices(base)):
        kwargs = _model_kwargs(base, batch)
        with apply_adacc(base, policy(None)):
            rec = activation_memory_report(base, kwargs)
        for g in groups:
            with apply_adacc(base, policy(g.name)):
                full[g.name] = activation_memory_report(base, kwargs).blocks[g.paths[0]]
    mean = {g.name: round(sum(rec.blocks[p] for p in g.paths) / len(g.paths)) for g in groups}
    return full, _Held(mean, rec.other, rec.largest_other)
