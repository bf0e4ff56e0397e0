"""The profiler: one block of each group measured on the real device, micro-batch and autocast.

`profile_model(model, sample_batch)` returns a `Profile`: per op (`ops`) its forward time, output
bytes and, for each codec that applies, the encoded bytes, encode + decode time and error on the
real activation; per block group (`memory`) what a checkpointed and a plain block hold, the
transients of their backward, their gradients and their place in the model; outside the blocks
what is held before and after them and the transients of the loss, the head and the embeddings.
It runs under full recomputation (plus one block at a time without it). Given ``room`` (the bytes
it may add above what is alive when it starts: the budget less the run's live state), every run
predicts its own peak first and runs only what fits: the LM head is measured on slices and
extrapolated when its full logits do not fit (and the timeline then runs with the chunked head),
plain-block runs that do not fit are skipped and estimated; no extra forward of the model runs for
the head. The solver turns a Profile and a budget into a Policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..adapters import get_adapter, unwrap_model
from ..runtime.checkpoint import frame_nbytes
from ..runtime.context import autocast_context, devices_of
from ..runtime.peak import batch_nbytes
from ..runtime.timing import modelled_device
from ..runtime.trace import run_representatives
from ..schema import GroupProfile, Profile
from ..verbosity import progress
from .compiled import lifted, measure_compiled
from .estimates import grad_nbytes, timeline_rest_nbytes
from .fidelity import measure_grad_errors
from .fingerprint import run_fingerprint
from .head import measure_heads
from .memory import StepMemory, measure, sharded
from .ops import GroupOps, candidate_codecs, op_visitor, profile_codec
from .phases import phase, recording
from .variants import BlockProbe, measure_policy, measure_variants, recompute_key

logger = logging.getLogger("adacc_hf")

__all__ = [
    "BlockProbe",
    "Profile",
    "StepMemory",
    "candidate_codecs",
    "capture_probes",
    "measure_heads",
    "measure_policy",
    "measure_variants",
    "profile_codec",
    "profile_model",
]


def profile_model(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    *,
    codecs: Iterable[str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    autocast: torch.dtype | None = None,
    reference: Profile | None = None,
    probes: dict | None = None,
    room: int | None = None,
    head: str = "auto",
    memory: bool = True,
    compile: str | None = None,
    codec_backends: Iterable[str] | None = None,
) -> Profile:
    """Measure one block of each group on the model's device with the real micro-batch.

    Per op: its forward time, output bytes and, for each codec that applies, the encoded bytes,
    encode + decode time and error on the real activation; per block group what a checkpointed
    and a plain block hold and their backward's transients; outside the blocks what the step
    holds and the transients of the loss, the head and the embeddings (see the module
    docstring). With a `reference` profile of the same model at another batch shape, op costs
    are scaled from it (memory is measured unless ``memory=False``). Where the time went is in
    the profile's ``phase_ms`` (`phases`).

    Args:
        model: the model (or a wrapper of it), on the device it trains on.
        sample_batch: a training micro-batch of the run's shape.
        codecs: widens the codecs profiled per op (default: the layer type's own codec).
        codec_params: the codecs' parameters by codec name (e.g. ``{"int4_outlier":
            {"zscore_threshold": 3.0}}``).
        repeats: timed runs per op after `warmup`; their medians are kept.
        warmup: untimed runs first.
        autocast: the dtype the run's forward autocasts to (bf16 / fp16 mixed precision), so
            ops, sizes and times are those of the run.
        reference: a profile of the same model at another batch shape to scale op costs from.
        probes: a dict that gets each group's profiled block and its inputs, for measuring
            action tables later (`variants.measure_variants`).
        room: the bytes profiling may add above what is alive when it starts (None: no limit;
            see the module docstring).
        head: the run's LM head option (``"auto"``, ``"full"``, ``"chunked"``); ``"full"``
            measures no other way (`head.measure_heads`).
        memory: False runs the op pass alone: the memory fields and heads are left empty for
            `derive.interpolate_memory`.
        compile: the ``torch.compile`` backend the blocks will run under; their memory is then
            measured compiled too and the profile moved by the difference (`compiled`).
        codec_backends: the codec implementations timed on each op, the fastest kept
            (`codecs.backends`; None: all on CUDA, the default one elsewhere:
            `ops.timed_backends`).

    Returns:
        The `Profile` the solver plans from.

    Raises:
        UnsupportedModelError: the model has no adapter (the message says what to change).
    """
    with recording() as phase_ms:
        profile = _profile_model(
            model,
            sample_batch,
            codecs=codecs,
            codec_params=codec_params,
            repeats=repeats,
            warmup=warmup,
            autocast=autocast,
            reference=reference,
            probes=probes,
            room=room,
            head=head,
            memory=memory,
            compile=compile,
            codec_backends=codec_backends,
        )
    profile.phase_ms = {k: round(v, 1) for k, v in phase_ms.items()}
    return profile


def _profile_model(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    *,
    codecs: Iterable[str] | None,
    codec_params: Mapping[str, Mapping[str, Any]] | None,
    repeats: int,
    warmup: int,
    autocast: torch.dtype | None,
    reference: Profile | None,
    probes: dict | None,
    room: int | None,
    head: str,
    memory: bool,
    compile: str | None,
    codec_backends: Iterable[str] | None = None,
) -> Profile:
    t_start = time.perf_counter()
    adapter = get_adapter(model)
    base = unwrap_model(model)
    device = next(base.parameters()).device
    if probes is None:  # the gradient-error pass below runs on the profiled blocks
        probes = {}
    measured: dict[str, GroupOps] = {}
    visit = op_visitor(
        device,
        measured,
        codecs=codecs,
        codec_params=codec_params,
        repeats=repeats,
        warmup=warmup,
        reference=reference.groups if reference is not None else None,
        probes=probes if not sharded(base) else None,  # a sharded block gathers across ranks
        backward=not sharded(base),
        codec_backends=codec_backends,
    )
    # Profiling draws no random numbers the run would see: its dropout masks stay those of a run
    # without Adacc.
    bar = progress(4, "adacc profiling: ops and codecs")
    # the policy applied to the model (a new bucket planned mid-run) is lifted: profiled
    # without Adacc
    with lifted(base):
        try:
            with torch.random.fork_rng(devices=devices_of(base)):
                with autocast_context(device, autocast, cache=False):
                    run_representatives(base, sample_batch, visit)
                bar.update(1)
                bar.set_description("adacc profiling: LM head and step memory")
                groups = adapter.block_groups(base)
                specs = {g.name: [o.spec() for o in measured[g.name].ops] for g in groups}
                batch = dict(sample_batch)
                heads, mem = _memory(
                    base, batch, groups, specs, autocast, room, head, memory, probes
                )
                bar.update(2)
                if mem.skipped:
                    logger.info(
                        "adacc: profiling within %.2f MiB skipped %s", room / 2**20, mem.skipped
                    )
        except BaseException:
            bar.close()
            raise

    positions = {id(mod): i for i, (_, mod) in enumerate(adapter.find_blocks(base))}
    gprofs = {}
    for g in groups:
        m = measured[g.name]
        gprofs[g.name] = GroupProfile(
            name=g.name,
            num_blocks=len(g.modules),
            input_nbytes=mem.held[g.name],
            full_nbytes=mem.full[g.name],
            fixed_ms=m.fixed_ms,
            transient_nbytes=mem.block_transient[g.name],
            block_fwd_ms=m.block_fwd_ms,
            ops=m.ops,
            plain_transient_nbytes=mem.plain_transient[g.name],
            output_nbytes=mem.output_nbytes[g.name],
            grad_nbytes=grad_nbytes([g.modules[0]]),
            positions=[positions[id(mod)] for mod in g.modules],
            forward_transient_nbytes=mem.block_fwd_transient.get(g.name, 0),
            plain_forward_transient_nbytes=mem.plain_fwd_transient.get(g.name, 0),
            full_interior_nbytes=mem.full_interior.get(g.name, 0),
            frame_nbytes=frame_nbytes(device.type),
            plain_cast_nbytes=mem.plain_casts.get(g.name, 0),
            dispatch_ms=m.dispatch_ms,
            calibration=m.calibration,
        )
    blocks_grads = sum(gp.grad_nbytes * gp.num_blocks for gp in gprofs.values())
    nonblock_grads = max(0, grad_nbytes([base]) - blocks_grads)
    timeline = mem.timeline
    shapes = {k: list(v.shape) for k, v in sample_batch.items() if isinstance(v, torch.Tensor)}
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    dev_name = str(device)
    if device.type == "cuda":
        dev_name += f" ({torch.cuda.get_device_name(device)})"
    if modelled_device() is not None:  # a dry run priced as a GPU it models (`devices`)
        dev_name = f"cuda ({modelled_device().label}, modelled)"
    profile = Profile(
        model_type=adapter.model_type(base),
        adapter=adapter.name,
        adapter_version=adapter.version,
        device=dev_name,
        dtype=str(dtype),
        batch_shape=shapes,
        groups=gprofs,
        nonblock_nbytes=mem.before + mem.after,
        head_transient_nbytes=mem.head_transient,
        profile_ms=(time.perf_counter() - t_start) * 1e3,
        autocast=str(autocast) if autocast is not None else None,
        nonblock_before_nbytes=mem.before,
        forward_transient_nbytes=mem.forward_transient,
        tail_transient_nbytes=mem.tail_transient,
        nonblock_grad_nbytes=nonblock_grads,
        batch_nbytes=batch_nbytes(sample_batch.values()),
        timeline=timeline,
        variant_transients={recompute_key(n): v for n, v in mem.recompute_alone.items()},
        heads=heads,
        library_version=__version__,
        fingerprint={
            **run_fingerprint(base, autocast, codecs, codec_params, compile, codec_backends),
            "heads": head,
        },
    )
    if compile is not None and memory and not probes:
        logger.warning(
            "adacc: the blocks of a sharded model (ZeRO-3 / FSDP) cannot run alone, so the "
            "profile for compile=%r stays eager: its compiled steps may hold other bytes than "
            "planned (docs/compile.md)",
            compile,
        )
    if compile is not None and memory and probes:
        bar.set_description("adacc profiling: compiled blocks")
        with (
            lifted(base),  # a new bucket's plan: its runs patch the model themselves
            torch.random.fork_rng(devices=devices_of(base)),
            phase("compiled"),
        ):
            measure_compiled(profile, base, batch, autocast, compile, probes, (groups, specs), room)
    if probes and modelled_device() is None:  # a dry run has no values to measure errors on
        bar.set_description("adacc profiling: gradient errors")
        with torch.random.fork_rng(devices=devices_of(base)), phase("grad_errors"):
            measure_grad_errors(profile, probes, autocast)
        profile.profile_ms = (time.perf_counter() - t_start) * 1e3
    bar.update(1)
    bar.close()
    return profile


def _memory(
    base: nn.Module,
    batch: dict[str, Any],
    groups: list,
    specs: dict,
    autocast: torch.dtype | None,
    room: int | None,
    head: str,
    memory: bool,
    probes: dict,
) -> tuple[dict, StepMemory]:
    """Each way of running the LM head and loss (a sharded head gathers across ranks; first: the
    timeline runs the chunked head where the model's own does not fit), then the step's memory
    (`memory.measure`); with ``memory=False`` the heads alone, and only where the run may choose
    another head than the model's own (the chunked head's peaks follow its chunk size, which no
    interpolation between buckets follows: `derive`), the memory left zero."""
    heads: dict = {}
    if memory or head != "full":
        with phase("head"):
            rest = timeline_rest_nbytes(base, groups, batch)
            if not sharded(base):
                heads = measure_heads(base, batch, autocast, room=room, head=head, rest_nbytes=rest)
    if not memory:
        zero = {g.name: 0 for g in groups}
        mem = StepMemory(zero, zero, 0, 0, 0, zero, block_transient=zero, plain_transient=zero)
        return heads, mem
    with phase("memory"):
        mem = measure(base, batch, groups, specs, autocast, room, heads, probes)
    return heads, mem


def capture_probes(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    profile: Profile,
    autocast: torch.dtype | None = None,
) -> dict[str, BlockProbe]:
    """The first block of each group with the inputs it gets from `sample_batch` (one forward,
    stopped after the last of them): a saved `profile`'s action tables measured on this run's
    blocks. Empty for a sharded model (its block gathers across ranks)."""
    base = unwrap_model(model)
    if sharded(base):
        return {}
    device = next(base.parameters()).device
    probes: dict[str, BlockProbe] = {}

    def visit(adapter, group, block, fn, args):
        ops = [o.spec() for o in profile.groups[group.name].ops]
        probes[group.name] = BlockProbe(group.name, group.paths[0], block, fn, args, ops)
        return fn(*args)

    with autocast_context(device, autocast, cache=False):
        run_representatives(base, sample_batch, visit)
    return probes
