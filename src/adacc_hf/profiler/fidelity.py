"""What a codec does to gradients, measured on the profiled block with the real batch.

A codec's error on its own output (``CodecProfile.rel_error``) says little about what reaches the
gradients: on the pretrained SmolLM2-135M an INT4 Q with 0.1 output error moves the whole model's
gradients by 0.19, a norm output with a larger error by less. So for each op and each lossy codec
profiled on it, the block that was profiled runs forward and backward on its recorded inputs
twice under the same seed: plain, and with only that op compressed and everything else
recomputed (so statistic ops after it see its decoded output, `policy.consistency`; and an op
autograd does not save acts through the later ops recomputed from it). The relative error of the
block's gradients (its input's and its parameters', the larger) is the op's
``CodecProfile.grad_error``. The upstream gradient is a fixed Gaussian draw.

A policy's block error is predicted by adding its ops' errors in quadrature
(`solver.cost_model.grad_error_of`):
measured on the whole SmolLM2, Q, K and V errors of 0.19, 0.25 and 0.13 compounded to 0.33
(quadrature 0.34; their plain sum 0.56). `block_error` measures a whole action table the same way,
for the session to check what the solver predicted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..codecs import get_codec
from ..policy.consistency import keeps_statistics, lossy
from ..runtime.context import autocast_context, detached_input
from ..schema import Action, OpProfile, Profile, Variant, codec_can_pay
from .calibrate import table_runtimes
from .variants import BlockProbe

__all__ = ["block_error", "measure_grad_errors", "op_grad_error_variant", "policy_block_error"]

_SEED = 20260801  # dropout masks and the upstream gradient: the same in every run


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _grads(
    probe: BlockProbe, runtime: Any, autocast: torch.dtype | None
) -> tuple[list[torch.Tensor], bool]:
    """Gradients of the block's input and parameters under `runtime` (None: the plain block),
    and whether the first is the input's."""
    x, x_in = detached_input(probe.args[0])
    params = [p for p in probe.block.parameters() if p.requires_grad]
    inputs = [t for t in (x, *params) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.manual_seed(_SEED)
    with autocast_context(x.device, autocast):
        args = (x_in, *probe.args[1:])
        y = _hidden(runtime(probe.fn, *args) if runtime is not None else probe.fn(*args))
    gen = torch.Generator(device=y.device).manual_seed(_SEED)
    up = torch.randn(y.shape, generator=gen, device=y.device, dtype=torch.float32).to(y.dtype)
    grads = torch.autograd.grad(y, inputs, grad_outputs=up, allow_unused=True)
    first_is_input = isinstance(x, torch.Tensor) and x.requires_grad
    return [
        torch.zeros_like(t) if g is None else g.detach() for t, g in zip(inputs, grads, strict=True)
    ], first_is_input


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if not b:
        return 0.0
    pairs = zip(a, b, strict=True)
    num = math.sqrt(sum(float((x.float() - y.float()).square().sum()) for x, y in pairs))
    den = math.sqrt(sum(float(y.float().square().sum()) for y in b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _error(got: tuple, ref: tuple) -> float:
    """The larger of the input gradient's and the parameter gradients' relative errors."""
    (g, has_x), (r, _) = got, ref
    parts = [_rel(g[1:], r[1:])] if has_x else [_rel(g, r)]
    if has_x:
        parts.append(_rel(g[:1], r[:1]))
    return max(parts)


def op_grad_error_variant(ops: list[OpProfile], key: str, action: Action) -> Variant:
    """Only `key` runs `action`; every other op is recomputed, so what the codec changes reaches
    every later op the backward uses (an op autograd does not save matters only through them):
    the most compressing this one op can do to the gradients."""
    return Variant(1, True, {key: action})


def block_error(
    probe: BlockProbe, variants: Iterable[Variant], autocast: torch.dtype | None = None
) -> list[float]:
    """The block's gradient error under each action table (see the module docstring)."""
    variants = list(variants)
    tables: dict[str, Variant | None] = {str(i): v for i, v in enumerate(variants)}
    tables["plain"] = None
    devices = [probe.args[0].device.index or 0] if probe.args[0].is_cuda else []
    runtimes = table_runtimes(probe.block, probe.path, probe.group, probe.ops, tables)
    with torch.random.fork_rng(devices=devices), runtimes as rts:
        ref = _grads(probe, None, autocast)
        return [_guarded_error(probe, rts[str(i)], autocast, ref) for i in range(len(variants))]


def _guarded_error(probe: BlockProbe, runtime: Any, autocast: Any, ref: tuple) -> float:
    """`_error` of one table, infinite when the block fails under it: a lossy value that feeds
    an integer computation (T5's relative-position buckets take a float log, then an index) can
    make its recompute index out of range. Such a choice must never be made."""
    try:
        return _error(_grads(probe, runtime, autocast), ref)
    except (RuntimeError, IndexError, ValueError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        return math.inf


def measure_grad_errors(
    profile: Profile, probes: Mapping[str, BlockProbe], autocast: torch.dtype | None = None
) -> int:
    """Fill ``grad_error`` of every lossy codec of every op of the profiled groups that could pay
    (`schema.codec_can_pay`: slower than recomputing its op, the solver never picks it, so on a
    CPU most are left unmeasured); returns how many it measured."""
    n = 0
    for name, probe in probes.items():
        group = profile.groups.get(name)
        if group is None:
            continue
        todo = [
            (op, cp)
            for op in group.ops
            if op.cacheable and not keeps_statistics(op)  # never compressed lossily
            for cp in op.codecs.values()
            if cp.grad_error is None
            and codec_can_pay(op, cp)  # else recompute beats it: the solver never picks it
            and not get_codec(cp.codec, **cp.params).lossless
        ]
        variants = [op_grad_error_variant(group.ops, op.key, cp.action()) for op, cp in todo]
        for (_, cp), err in zip(todo, block_error(probe, variants, autocast), strict=True):
            cp.grad_error = err
            n += 1
    return n


def policy_block_error(
    probes: Mapping[str, BlockProbe], policy: Any, autocast: torch.dtype | None = None
) -> float:
    """The largest gradient error of a profiled block under any action table `policy` (a
    `Policy`) runs that compresses lossily, measured (0 when none does)."""
    worst = 0.0
    for name, g in policy.groups.items():
        probe = probes.get(name)
        if probe is None:
            continue
        used = [
            v
            for v in g.variants
            if v.count and v.checkpoint and any(lossy(a) for a in v.actions.values())
        ]
        if used:
            worst = max(worst, *block_error(probe, used, autocast))
    return worst
