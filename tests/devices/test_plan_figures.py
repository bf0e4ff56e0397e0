"""A plan's figures stay physically possible when the timings they come from are noisy.

Every time a plan adds (a recompute, a codec, the runtime's dispatch modes, a chunked head) is a
difference of two timings, the work run and not run, and on a loaded machine either may be the
more disturbed one: `make demo` once printed "predicted step peak 2.30 GiB of the 2.32 GiB
budget; -209.9 ms/step" for a plan recomputing 6 blocks. Here a real profile of a tiny llama is
taken with its whole-block timings disturbed against the plain block (timed the slowest in every
round, as when another job takes the core each time it runs) and its dispatch overhead timed with
half its runs disturbed; plans solved from it, with their action tables timed under the same noise,
must print no negative or impossible figure, and the solver must see no negative cost.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
from test_dispatch_cost import Disturbed

from adacc_hf import assets, profile_model
from adacc_hf.policy.display import card_section, describe, metrics, totals
from adacc_hf.profiler import calibrate, measure_policy, variants
from adacc_hf.runtime import overhead
from adacc_hf.runtime.timing import added_work_ms, least_added_ms, paired_added_ms
from adacc_hf.schema import variant_key
from adacc_hf.solver import budget_between, predict, solve
from adacc_hf.solver.cost_model import group_models

#: A negative number in printed text (not a hyphen inside a name such as "int4-asym").
NEGATIVE = re.compile(r"(?<![\w.])-\s?\d")
REAL_INTERLEAVED = calibrate.interleaved_ms


def plain_slowest(*args, **kwargs) -> dict[str, list[float]]:
    """`calibrate.interleaved_ms` with the plain block disturbed in every round: timed at its
    time plus twice the slowest table's of that round, so every table seems to save time."""
    times = REAL_INTERLEAVED(*args, **kwargs)
    worst = [max(r) for r in zip(*times.values(), strict=True)]
    times["plain"] = [t + 2 * w for t, w in zip(times["plain"], worst, strict=True)]
    return times


@pytest.fixture(scope="module")
def noisy():
    """(profile, probes) of the tiny llama, profiled under `plain_slowest` and `Disturbed`
    timings, which stay on through the module's tests (the tables they time)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(calibrate, "interleaved_ms", plain_slowest)
    mp.setattr(variants, "interleaved_ms", plain_slowest)
    mp.setattr(overhead, "time", Disturbed(0, 0.5))
    try:
        model = assets.tiny_model("llama")
        probes: dict = {}
        prof = profile_model(model, assets.tiny_batch("llama", model), repeats=1, probes=probes)
        yield prof, probes
    finally:
        mp.undo()


def recomputes(policy, prof) -> bool:
    """Whether `policy` recomputes some op that took measurable time."""
    for name, g in policy.groups.items():
        ops = {o.key: o for o in prof.groups[name].ops if o.cacheable}
        for v in g.variants:
            rerun = (v.action(k).kind == "recompute" and o.fwd_ms > 0 for k, o in ops.items())
            if v.count and v.checkpoint and any(rerun):
                return True
    return False


def check_lines(policy) -> None:
    """No plan line, log metric or card line shows a negative or undefined figure, and a plan
    said to be within its budget is predicted within it."""
    text = "\n".join([describe(policy), card_section(policy)])
    assert not NEGATIVE.search(text), text
    assert "nan" not in text and "inf " not in text, text
    for k, v in metrics(policy).items():
        assert math.isfinite(v) and v >= 0, (k, v)
    pred, budget = policy.metadata["predicted"], policy.metadata.get("budget_nbytes")
    if isinstance(budget, int) and "of the " in describe(policy):
        assert pred["peak_nbytes"] <= budget


def check_solver_costs(prof) -> None:
    for gm in group_models(prof, None, 0.5):
        assert gm.prof.fixed_ms >= 0
        for op, choices in gm.ops:
            assert op.fwd_ms >= 0
            assert all(c.ms >= 0 for c in choices), (op.key, choices)


def test_added_times_are_work_never_below_zero():
    # paired rounds: the median difference; a plain run disturbed in most rounds is no saving
    assert paired_added_ms([12.0, 11.0, 13.0], [10.0, 10.0, 10.0]) == 2.0
    assert paired_added_ms([12.0, 11.0, 13.0, 12.0, 12.0], [30.0, 10.0, 40.0, 10.0, 25.0]) == 0.0
    # least-disturbed runs: the minima's difference, whatever disturbed the others
    assert least_added_ms([3.0, 40.0, 2.5, 9.0], [1.0, 1.5, 30.0, 7.0]) == 1.5
    assert least_added_ms([3.0, 2.9], [3.5, 3.1]) == 0.0
    assert added_work_ms(-209.9) == 0.0 and added_work_ms(math.nan) == 0.0
    assert added_work_ms(1.25) == 1.25


def test_the_profilers_added_times_hold_under_noise(noisy):
    prof, _ = noisy
    g = prof.groups["block"]
    cal = g.calibration
    # the disturbance took: the plain block was timed above every table
    assert cal["rounds"] and cal["plain_ms"] > 0
    for k in ("recompute_ms", "keep_ms", "codec_ms", "dispatch_ms"):
        assert cal[k] >= 0, (k, cal[k])
    # the dispatch modes run Python for every op: never free, whatever disturbed half the runs
    assert g.dispatch_ms > 0
    check_solver_costs(prof)


def test_no_plan_line_prints_a_negative_or_impossible_figure(noisy):
    prof, probes = noisy
    prof = copy.deepcopy(prof)
    # the chunked head timed faster than the model's own (noise: it runs the same matmuls and
    # reruns each chunk's logits in backward)
    assert {"full", "chunked"} <= set(prof.heads)
    full = prof.heads["full"]
    prof.heads["chunked"] = dataclasses.replace(prof.heads["chunked"], ms=full.ms / 4)
    seen_recompute = False
    cases = [("full", 0.0), ("full", 0.3), ("full", 0.7), ("full", 1.0), ("chunked", 0.3)]
    for head, fraction in [*cases, ("chunked", 1.0)]:
        sol = solve(prof, budget_between(prof, 0, fraction), head=head)
        assert sol.added_ms >= 0
        policy = sol.policy
        measure_policy(prof, probes, policy)  # its tables timed whole, plain disturbed
        for key in {variant_key(n, v) for n, g in policy.groups.items() for v in g.variants}:
            assert prof.variant_ms.get(key, 0.0) >= 0, (key, prof.variant_ms)
        final = predict(prof, policy)
        assert final.added_ms >= 0
        if recomputes(policy, prof):
            seen_recompute = True
            assert final.added_ms > 0, (totals(policy), final.added_ms)
        policy.metadata["predicted"]["added_ms"] = final.added_ms  # as the session does
        check_lines(policy)
    assert seen_recompute
    check_solver_costs(prof)


def test_a_saved_profile_with_negative_timings_prices_no_saving(noisy):
    """A profile saved before the rule (its tables timed below the plain block, a negative
    dispatch overhead) still prices a plan that recomputes as costing time."""
    prof = copy.deepcopy(noisy[0])
    sol = solve(prof, budget_between(prof, 0, 0.3))
    policy = sol.policy
    assert recomputes(policy, prof)
    by_ops = predict(prof, policy, measured_ms=False).added_ms
    assert by_ops > 0
    for n, g in policy.groups.items():
        for v in g.variants:
            if v.checkpoint:
                prof.variant_ms[variant_key(n, v)] = -35.0  # 6 blocks: the demo's -209.9 ms
    prof.groups["block"] = dataclasses.replace(prof.groups["block"], dispatch_ms=-1.0)
    pred = predict(prof, policy)
    assert pred.added_ms > 0
    # priced by its ops (a dispatch overhead below 0 counts 0)
    zero = copy.deepcopy(prof)
    zero.groups["block"] = dataclasses.replace(zero.groups["block"], dispatch_ms=0.0)
    assert pred.added_ms == pytest.approx(predict(zero, policy, measured_ms=False).added_ms)
    policy.metadata["predicted"]["added_ms"] = pred.added_ms
    check_lines(policy)
    again = solve(prof, budget_between(prof, 0, 0.3))
    assert again.added_ms > 0
    check_solver_costs(prof)
