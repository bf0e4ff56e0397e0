"""Adacc as a user gets it, for the benchmarks: its profile, its session, the budget range.

`profile_for` makes the profile `adacc_hf.prepare` makes (each layer type's own codec) and, for the
outlier-separation ablation, a copy whose int4_outlier measurements are int4_naive's
(`no_outlier_profile`). `solved_session` solves through `AdaccSession`, so the benchmarks get the
headroom, codec error limit and solver settings users get. `budget_range` spans the budgets worth
benchmarking: the smallest any policy fits in, to what no checkpointing needs.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from adacc_hf.engine.config import AdaccConfig
from adacc_hf.engine.options import CodecOptions
from adacc_hf.engine.session import AdaccSession
from adacc_hf.profiler import BlockProbe, profile_model
from adacc_hf.schema import Profile
from adacc_hf.solver import StaticMemory, min_budget, no_checkpoint_budget

#: The ablation's stand-in for int4_outlier: the same groups of 64 channels, no outlier channels.
NO_OUTLIER_CODEC = ("int4_naive", {"group_size": 64})


@dataclass
class Profiles:
    """Adacc's profile of one model and micro-batch, shared by the Adacc strategies."""

    adacc: Profile
    no_outlier: Profile | None = None
    profile_s: float = 0.0  # wall time of the user-facing profile (adacc's own)
    # each group's profiled block and its inputs: a solve times its action tables there, as the
    # session does for users (`BucketSolver.solve_measured`)
    probes: dict[str, BlockProbe] = field(default_factory=dict)


def no_outlier_profile(profile: Profile, naive: Profile) -> Profile:
    """`profile` with every op's int4_outlier measurement replaced by int4_naive's (same groups of
    64, no outlier channels) from `naive`, a profile of the same model and batch. Op times stay
    those of `profile`, so the solver's choices differ only through the codec."""
    out = copy.deepcopy(profile)
    codec = NO_OUTLIER_CODEC[0]
    naive_ops = {(g, o.key): o for g, gp in naive.groups.items() for o in gp.ops}
    for gname, g in out.groups.items():
        for i, op in enumerate(g.ops):
            if "int4_outlier" not in op.codecs:
                continue
            codecs = {k: v for k, v in op.codecs.items() if k != "int4_outlier"}
            other = naive_ops.get((gname, op.key))
            if other is not None and codec in other.codecs:
                codecs[codec] = other.codecs[codec]
            g.ops[i] = replace(op, codecs=codecs)
    return out


def profile_for(
    model: nn.Module, batch: Mapping[str, Any], repeats: int = 3, *, no_outlier: bool = True
) -> Profiles:
    """The profile `adacc_hf.prepare` makes (each layer type's own codec), plus the ablation's."""
    t0 = time.perf_counter()
    probes: dict[str, BlockProbe] = {}
    prof = profile_model(
        model, batch, codec_params=CodecOptions().codec_params(), repeats=repeats, probes=probes
    )
    took = time.perf_counter() - t0
    naive = None
    if no_outlier:
        codec, params = NO_OUTLIER_CODEC
        raw = profile_model(model, batch, codecs=[codec], codec_params={codec: params}, repeats=1)
        naive = no_outlier_profile(prof, raw)
    return Profiles(prof, naive, took, probes)


def cheaper_codecs(profiles: Profiles, speedup: float) -> Profiles:
    """`profiles` with every codec's encode and decode time divided by `speedup` (the prices of
    a GPU, where the kernels make codecs cheap, on a CPU run: the solver then compresses)."""
    if speedup == 1:
        return profiles
    out = Profiles(
        copy.deepcopy(profiles.adacc),
        copy.deepcopy(profiles.no_outlier),
        profiles.profile_s,
        profiles.probes,  # blocks and their inputs: shared, not copied
    )
    for prof in (out.adacc, out.no_outlier):
        for g in prof.groups.values() if prof is not None else ():
            for op in g.ops:
                for cp in op.codecs.values():
                    cp.encode_ms, cp.decode_ms = cp.encode_ms / speedup, cp.decode_ms / speedup
    return out


def budget_range(profile: Profile, static: int | StaticMemory = 0) -> tuple[int, int]:
    """(lo, hi): the smallest budget any policy fits in; what no checkpointing needs (step
    peaks, `adacc_hf.solver.step`)."""
    return min_budget(profile, static), no_checkpoint_budget(profile, static)


def solved_session(
    model: nn.Module,
    profile: Profile,
    budget_nbytes: int,
    static: int | StaticMemory,
    *,
    adaptive: bool = False,
    profile_repeats: int = 3,
    probes: dict[str, BlockProbe] | None = None,
) -> AdaccSession:
    """An `AdaccSession` for `profile` under `budget_nbytes`, its policy solved as users get it
    (raises `BudgetError` when none fits): with `probes`, its action tables measured and timed on
    them and solved again (`BucketSolver.solve_measured`; the session's profile holds what was
    measured). Not yet applied to the model."""
    cfg = AdaccConfig(budget=int(budget_nbytes), adaptive=adaptive, profile_repeats=profile_repeats)
    solver = AdaccSession(model, cfg)
    if isinstance(static, StaticMemory):
        solver.static = static
    else:
        solver.static = StaticMemory(params=int(static), grads=0, optimizer=0, master_weights=0)
    profile = copy.deepcopy(profile)
    policy = solver.solver.solve_measured(profile, probes or {})
    session = AdaccSession(model, cfg, policy=policy, profile=profile)
    session.static = solver.static
    return session
