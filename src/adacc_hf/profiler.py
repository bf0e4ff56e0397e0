"""The profiler: one block of each group measured on the real device and micro-batch.

`profile_model(model, sample_batch)` returns a `Profile`: per op its forward time, output bytes and,
for each codec that applies, the encoded bytes, encode + decode time and error measured on the real
activation; per block group the bytes a checkpointed block always holds (its input), the
no-checkpoint bytes, the fixed recompute cost, and the transient memory of one block's backward;
plus the activations held outside the blocks. The solver turns a Profile and a budget into a Policy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ._version import __version__
from .adapters import get_adapter, unwrap_model
from .codecs import Codec, get_codec, payload_finite, relative_error
from .policy import Policy
from .runtime import apply_adacc
from .runtime.checkpoint import dispatch_overhead_ms
from .runtime.memory import activation_memory_report
from .runtime.ops import cache_target, storage_id, tensor_outputs
from .runtime.timing import elapsed_ms, sync, time_call, timer_for
from .runtime.trace import (
    devices_of,
    first_tensor_nbytes,
    model_kwargs,
    record_block,
    run_representatives,
    train_mode,
)
from .schema import (
    CodecProfile,
    GroupPolicy,
    GroupProfile,
    OpProfile,
    OpSpec,
    Profile,
    Variant,
    codec_candidates,
)

__all__ = ["Profile", "candidate_codecs", "profile_codec", "profile_model"]


def candidate_codecs(
    op: OpSpec,
    allowed: Iterable[str] | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Codec]:
    """The codecs to profile on an op (`schema.codec_candidates`), built with their `params`."""
    params = params or {}
    return [get_codec(n, **dict(params.get(n, {}))) for n in codec_candidates(op, allowed)]


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
    if not payload_finite(enc):
        return None
    err = float(relative_error(x, codec.decode(enc)))
    if err == float("inf"):
        return None
    return CodecProfile(
        codec=codec.name,
        params=codec.params(),
        nbytes=enc.nbytes(),
        encode_ms=time_call(lambda: codec.encode(x), device, repeats),
        decode_ms=time_call(lambda: codec.decode(enc), device, repeats),
        rel_error=err,
        n_outliers=int(enc.meta.get("outlier_count", 0)),
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
    base = unwrap_model(model)
    device = next(base.parameters()).device
    handle = base.__dict__.get("_adacc_handle")
    active = handle.policy if handle is not None and handle.active else None
    if active is not None:
        handle.remove()
    allowed = list(codecs) if codecs is not None else None
    timer = timer_for(device)
    measured: dict[str, dict[str, Any]] = {}

    def visit(adapter, group, block, fn, args):
        for _ in range(warmup):
            fn(*args)
        runs = []
        for _ in range(repeats):
            out, rec, ops = record_block(adapter, group, block, fn, args, timer=timer)
            runs.append(rec)
        sync(device)
        keys = [op.key for op in ops]
        fwd = {
            k: statistics.median(elapsed_ms(r.recs[i].elapsed) for r in runs)
            for i, k in enumerate(keys)
        }
        other = statistics.median(sum(elapsed_ms(e) for e in r.other_ms) for r in runs)
        block_ms = time_call(lambda: fn(*args), device, max(1, repeats // 2))
        outs = _storages(out)
        # The hidden states go on to the next block; other outputs (attention weights GPT-J and
        # Bloom return, T5's position bias) are held anyway only if later blocks read them.
        hidden = out[0] if isinstance(out, (tuple, list)) and out else out
        main = _storages(hidden)
        last = runs[-1]
        op_profiles, aux_shared = [], []
        for op, raw in zip(ops, last.outputs, strict=True):
            tensors = tensor_outputs(raw)

            def shared(storages: set[int], tensors=tensors) -> int:
                return sum(
                    t.numel() * t.element_size()
                    for t in tensors
                    if t.numel() and storage_id(t) in storages
                )

            prof = OpProfile.from_spec(
                op,
                fwd_ms=fwd[op.key],
                block_output=bool(_storages(raw) & outs),
                shared_nbytes=shared(main),
            )
            aux_shared.append(shared(outs - main))
            if op.cacheable and tensors:
                for codec in candidate_codecs(op, allowed, codec_params):
                    cp = profile_codec(codec, cache_target(op.mask, raw), device)
                    if cp is not None:
                        prof.codecs[codec.name] = cp
            op_profiles.append(prof)
        gp = GroupPolicy(ops=ops, variants=[Variant(len(group.modules), True, {})])
        measured[group.name] = {
            "dispatch_ms": dispatch_overhead_ms(block, fn, args, gp, device, repeats),
            "ops": op_profiles,
            "aux_shared": aux_shared,
            "hidden_nbytes": sum(t.numel() * t.element_size() for t in tensor_outputs(hidden)),
            "fixed_ms": other + sum(p.fwd_ms for p in op_profiles if not p.cacheable),
            "block_fwd_ms": block_ms,
            "input_guess": first_tensor_nbytes(args),
        }
        del runs, last
        return out

    try:
        run_representatives(base, sample_batch, visit)
        groups = adapter.block_groups(base)
        specs = {g.name: [o.spec() for o in measured[g.name]["ops"]] for g in groups}
        full, held = _block_memory(base, sample_batch, groups, specs)
    finally:
        if active is not None:
            handle.set_policy(active)

    gprofs = {}
    for g in groups:
        m = measured[g.name]
        input_nbytes = held.blocks_mean[g.name]
        # Under full recomputation a block holds what it creates and others keep: its output
        # when the next block (or the final norm) saves it, which not every final norm does
        # (Cohere's), and other outputs later blocks read. Retaining an op costs only the part
        # of its output that nothing holds anyway (on average over the group's blocks).
        kept = [min(1.0, held.blocks[p] / max(1, m["hidden_nbytes"])) for p in g.paths]
        frac = sum(kept) / len(kept)
        aux = input_nbytes > m["input_guess"]
        m["ops"] = [
            replace(o, shared_nbytes=round(o.shared_nbytes * frac) + (a if aux else 0))
            for o, a in zip(m["ops"], m["aux_shared"], strict=True)
        ]
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
            dispatch_ms=m["dispatch_ms"],
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
        library_version=__version__,
    )


@dataclass
class _Held:
    blocks_mean: dict[str, int]
    blocks: dict[str, int]  # per block path
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
    with train_mode(base), torch.random.fork_rng(devices=devices_of(base)):
        kwargs = model_kwargs(base, batch)
        with apply_adacc(base, policy(None)):
            rec = activation_memory_report(base, kwargs)
        for g in groups:
            with apply_adacc(base, policy(g.name)):
                full[g.name] = activation_memory_report(base, kwargs).blocks[g.paths[0]]
    mean = {g.name: round(sum(rec.blocks[p] for p in g.paths) / len(g.paths)) for g in groups}
    return full, _Held(mean, rec.blocks, rec.other, rec.largest_other)
