"""Per op of one block of each group: forward time, output bytes, and each candidate codec's
encoded bytes, encode + decode time and error, measured on the real activation."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..codecs import (
    Codec,
    backends,
    dtype_named,
    get_codec,
    has_sentinels,
    payload_finite,
    relative_error,
)
from ..runtime.kept import generator_state_nbytes
from ..runtime.ops import cache_target, storage_id, tensor_outputs
from ..runtime.overhead import dispatch_overhead_ms
from ..runtime.peak import AllocationTracker
from ..runtime.timing import elapsed_ms, modelled_device, sync, time_call, timer_for, work_clock
from ..runtime.trace import record_block
from ..schema import (
    CodecProfile,
    GroupPolicy,
    GroupProfile,
    OpProfile,
    OpSpec,
    Variant,
    codec_candidates,
)
from .calibrate import calibrate
from .phases import phase
from .variants import BlockProbe


def candidate_codecs(
    op: OpSpec,
    allowed: Iterable[str] | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Codec]:
    """The codecs to profile on an op (`schema.codec_candidates`), built with their `params`."""
    params = params or {}
    return [get_codec(n, **dict(params.get(n, {}))) for n in codec_candidates(op, allowed)]


def _masked(x: torch.Tensor) -> bool:
    """Whether `x` holds mask sentinels (`codecs.has_sentinels`; a modelled device's dry run has
    no values to read: never)."""
    return modelled_device() is None and has_sentinels(x)


def timed_backends(
    codec: Codec, device: torch.device, allowed: Iterable[str] | None = None
) -> list[str]:
    """The backends `profile_codec` times for `codec` on `device`: of `allowed` (None: every
    backend on CUDA; elsewhere the kernel mode's choice alone, as compiling per shape costs a
    CPU run more than it saves), those the codec has that can run there."""
    if allowed is None:
        if device.type != "cuda":
            return [backends.resolve(codec, device)]
        allowed = backends.BACKENDS
    own = backends.backends_of(codec.name)
    return [b for b in allowed if b in own and backends.unavailable(codec.name, b, device) is None]


def profile_codec(
    codec: Codec,
    x: torch.Tensor,
    device: torch.device,
    repeats: int = 3,
    backends_allowed: Iterable[str] | None = None,
) -> CodecProfile | None:
    """Encode/decode time, exact encoded size and error of `codec` on the real tensor `x`, on
    the fastest of its backends measured here (`timed_backends`; every one gives the same
    payload, so size and error are the fastest's).

    None when the codec cannot encode `x` (non-finite values, e.g. -inf masked scores).
    """
    if not codec.applicable(x):
        return None
    x = x.detach()
    modelled = modelled_device()
    if modelled is not None:
        return modelled_codec(codec, x, modelled, backends_allowed)
    clock = work_clock(device)
    names = timed_backends(codec, device, backends_allowed)
    times: dict[str, list[float]] = {}
    for name in names:
        run = get_codec(codec.name, backend=name, **codec.params())
        warm = run.encode(x)  # the first call compiles or tunes where the backend does
        run.decode(warm)
        times[name] = [
            time_call(lambda run=run: run.encode(x), device, repeats, clock),
            time_call(lambda run=run, e=warm: run.decode(e), device, repeats, clock),
        ]
        del warm
    best = min(times, key=lambda n: sum(times[n]))
    codec = get_codec(codec.name, backend=best, **codec.params())
    tracker = AllocationTracker(device)
    with tracker:
        enc = codec.encode(x)
        tracker.mark("encoded")
        dec = codec.decode(enc)
        tracker.mark("decoded")
    encode_ws = tracker.peak(None, "encoded") - enc.nbytes()
    out_nbytes = dec.numel() * dec.element_size()
    decode_ws = tracker.peak("encoded", "decoded") - tracker.level("encoded") - out_nbytes
    if not payload_finite(enc):
        return None
    err = float(relative_error(x, dec))
    del dec
    if err == float("inf"):
        return None
    return CodecProfile(
        codec=codec.name,
        params=codec.params(),
        nbytes=enc.nbytes(),
        encode_ms=times[best][0],
        decode_ms=times[best][1],
        rel_error=err,
        n_outliers=int(enc.meta.get("outlier_count", 0)),
        encode_workspace_nbytes=max(0, encode_ws),
        decode_workspace_nbytes=max(0, decode_ws),
        backend=best if len(times) > 1 else "",
        backend_ms=times if len(times) > 1 else {},
    )


def modelled_codec(
    codec: Codec, x: torch.Tensor, modelled: Any, allowed: Iterable[str] | None = None
) -> CodecProfile | None:
    """`codec` on an op of `x`'s shape on a modelled device (`runtime.timing.modelled`): its
    exact payload size, the fastest of the backends the device's table prices (None: it prices
    none), no workspace beyond the payload (a kernel's), and errors unknown (0: `x` holds no
    values; the run measures them)."""
    nbytes = codec.predict_nbytes(x.shape, x.dtype)
    in_nbytes = x.numel() * x.element_size()
    times = {}
    for b in modelled.codec_backends(codec.name):
        if allowed is None or b in allowed or b == "modelled":
            got = modelled.codec_ms(codec.name, b, in_nbytes, nbytes)
            if got is not None:
                times[b] = list(got)
    if not times:
        return None
    best = min(times, key=lambda n: sum(times[n]))
    return CodecProfile(
        codec=codec.name,
        params=codec.params(),
        nbytes=nbytes,
        encode_ms=times[best][0],
        decode_ms=times[best][1],
        rel_error=0.0,
        backend="" if best == "modelled" else best,
        backend_ms=times,
    )


def _storages(out: Any) -> set[int]:
    return {storage_id(t) for t in tensor_outputs(out) if t.numel()}


@dataclass
class GroupOps:
    """What the op-level pass measured on one block of a group."""

    ops: list[OpProfile]
    fixed_ms: float  # ops that always rerun (views, in-place, random): their recompute time
    block_fwd_ms: float
    dispatch_ms: float = 0.0  # the runtime's dispatch modes on a block that keeps an op
    calibration: dict[str, float] = field(default_factory=dict)  # `calibrate.Calibration`


def _untimed(func, args, kwargs):
    return func(*args, **kwargs), 0.0


def scaled(ops: list[OpSpec], outputs: list, outs: set[int], ref: GroupProfile) -> GroupOps | None:
    """The ops of a block at another shape, costed from `ref` (the same ops measured at another
    shape): times and codec workspaces scale with the output's elements, codec sizes are exact
    (``predict_nbytes``, with `ref`'s outlier counts), errors carry over. None if an op has no
    counterpart with the same signature in `ref`."""
    by_key = {o.key: o for o in ref.ops}
    if len(ops) != len(ref.ops):
        return None
    out, ratios = [], []
    for op, raw in zip(ops, outputs, strict=True):
        r = by_key.get(op.key)
        if r is None or r.signature != op.signature or len(r.shape) != len(op.shape):
            return None
        ratio = op.numel / max(1, r.numel)
        ratios.append(ratio)
        tensors = tensor_outputs(raw)
        prof = OpProfile.from_spec(
            op,
            fwd_ms=r.fwd_ms * ratio,
            rng_nbytes=r.rng_nbytes,  # the same op, the same device
            block_output=bool(_storages(raw) & outs),
            shared_nbytes=sum(
                t.numel() * t.element_size() for t in tensors if t.numel() and storage_id(t) in outs
            ),
        )
        dtype = dtype_named(op.dtype)
        masked = bool(tensors) and _masked(cache_target(op.mask, raw))
        for name, cp in {} if masked else r.codecs.items():
            codec = get_codec(name, **cp.params)
            prof.codecs[name] = CodecProfile(
                codec=name,
                params=dict(cp.params),
                nbytes=codec.predict_nbytes(op.shape, dtype, cp.n_outliers),
                encode_ms=cp.encode_ms * ratio,
                decode_ms=cp.decode_ms * ratio,
                rel_error=cp.rel_error,
                n_outliers=cp.n_outliers,
                encode_workspace_nbytes=round(cp.encode_workspace_nbytes * ratio),
                decode_workspace_nbytes=round(cp.decode_workspace_nbytes * ratio),
                grad_error=cp.grad_error,  # relative: carries over like rel_error
                backend=cp.backend,
                backend_ms={b: [t * ratio for t in ts] for b, ts in cp.backend_ms.items()},
            )
        out.append(prof)
    mean = sum(ratios) / max(1, len(ratios))
    # the dispatch overhead is per op crossing Python, whatever the shape
    return GroupOps(
        out, ref.fixed_ms * mean, ref.block_fwd_ms * mean, ref.dispatch_ms, dict(ref.calibration)
    )


def op_visitor(
    device: torch.device,
    measured: dict[str, GroupOps],
    *,
    codecs: Iterable[str] | None,
    codec_params: Mapping[str, Mapping[str, Any]] | None,
    repeats: int,
    warmup: int,
    reference: Mapping[str, GroupProfile] | None = None,
    probes: dict | None = None,
    backward: bool = True,
    codec_backends: Iterable[str] | None = None,
):
    """A `run_representatives` visitor that times every op of the block `repeats` times (after
    `warmup` runs) and profiles each candidate codec on the op's real output, then scales those
    times to the block's measured forward + backward (`calibrate`; with ``backward=False``, e.g.
    a sharded block, only the forward's dispatch overhead is measured); with a `reference`
    profile of the same model at another shape, it only traces the block and scales the
    reference's costs (`scaled`), measuring the group anew where the ops differ. `probes`, when
    given, gets each group's block and inputs (`variants.BlockProbe`); `codec_backends`: the
    codec backends timed per op (`timed_backends`)."""
    allowed = list(codecs) if codecs is not None else None
    codec_backends = list(codec_backends) if codec_backends is not None else None
    timer = timer_for(device)

    def visit(adapter, group, block, fn, args):
        out = _visit(adapter, group, block, fn, args)
        if probes is not None:
            specs = [o.spec() for o in measured[group.name].ops]
            probes[group.name] = BlockProbe(group.name, group.paths[0], block, fn, args, specs)
        return out

    def _visit(adapter, group, block, fn, args):
        ref = reference.get(group.name) if reference else None
        if ref is not None:
            with phase("ops"):
                out, rec, ops = record_block(adapter, group, block, fn, args, timer=_untimed)
                got = scaled(ops, rec.outputs, _storages(out), ref)
            if got is not None:
                measured[group.name] = got
                return out
        with phase("ops"):
            for _ in range(warmup):
                fn(*args)
            runs = []
            for _ in range(repeats):
                if runs:  # drop the last run's outputs first, as a training step frees its own
                    runs[-1].outputs = []
                out = None
                out, rec, ops = record_block(adapter, group, block, fn, args, timer=timer)
                runs.append(rec)
            sync(device)
            fwd = [
                statistics.median(elapsed_ms(r.recs[i].elapsed) for r in runs)
                for i in range(len(ops))
            ]
            other = statistics.median(sum(elapsed_ms(e) for e in r.other_ms) for r in runs)
            clock = work_clock(device)
            block_ms = time_call(lambda: fn(*args), device, max(1, repeats // 2), clock)
        outs = _storages(out)
        op_profiles = []
        for op, ms, raw in zip(ops, fwd, runs[-1].outputs, strict=True):
            tensors = tensor_outputs(raw)
            prof = OpProfile.from_spec(
                op,
                fwd_ms=ms,
                rng_nbytes=op.rng_states * generator_state_nbytes(device.type),
                block_output=bool(_storages(raw) & outs),
                shared_nbytes=sum(
                    t.numel() * t.element_size()
                    for t in tensors
                    if t.numel() and storage_id(t) in outs
                ),
            )
            # Masked outputs (attention scores with -inf / finfo.min) stay exact: a lossy codec
            # would scale to the sentinels and ruin what the mask leaves visible.
            target = cache_target(op.mask, raw) if tensors else None
            if op.cacheable and target is not None and not _masked(target):
                with phase("codecs"):
                    for codec in candidate_codecs(op, allowed, codec_params):
                        cp = profile_codec(codec, target, device, backends_allowed=codec_backends)
                        if cp is not None:
                            prof.codecs[codec.name] = cp
            op_profiles.append(prof)
        fixed = other + sum(p.fwd_ms for p in op_profiles if not p.cacheable)
        del runs
        if not backward:
            gp = GroupPolicy(ops=ops, variants=[Variant(len(group.modules), True, {})])
            with phase("calibration"):
                d_ms = dispatch_overhead_ms(block, fn, args, gp, device, repeats)
            measured[group.name] = GroupOps(op_profiles, fixed, block_ms, d_ms)
            return out
        with phase("calibration"):
            cal = calibrate(
                block, group.paths[0], group.name, fn, args, op_profiles, fixed, device, repeats
            )
        op_profiles, fixed = cal.apply(op_profiles, fixed)
        measured[group.name] = GroupOps(op_profiles, fixed, block_ms, cal.dispatch_ms, asdict(cal))
        return out

    return visit
