"""Solving a bucket's plan: `BucketSolver.solve` under the budget, then `solve_measured` with the
action tables and gradient error the policy runs measured on the profiled blocks, and the final
prediction checked against the budget with every measured table in it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..adapters import unwrap_model
from ..errors import AdaccError, BudgetError
from ..evolution import tracking_need, tracking_room_cap
from ..policy import Policy
from ..profiler import BlockProbe, measure_policy
from ..profiler.compiled import measure_plan
from ..profiler.fidelity import policy_block_error
from ..profiler.phases import phase
from ..runtime.offload import measure_link
from ..schema import OffloadLink, Profile
from ..solver import headroom_for, least_memory_policy, planned_budget, predict, solve_policy
from ..solver.cost_model import plan_key_of
from ..units import fmt_bytes
from .context import SessionContext

__all__ = ["BucketSolver"]

logger = logging.getLogger("adacc_hf")

#: A compiled plan measured this far under the limit (a share of the limit less static memory)
#: is solved once more.
SLACK = 0.02
#: Solves at most, an adaptive plan solved again with its tracking step's room kept free.
TRACKING_SOLVES = 3


class BucketSolver:
    """Solves a bucket's profile under the session's budget, measuring what the policy runs.

    Args:
        ctx: the session's shared state.
    """

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx
        self._link: OffloadLink | None = None  # measured once, on the first plan that may offload

    def offload_link(self) -> OffloadLink | None:
        """The host link plans may offload over (measured once per session), or None where the
        config keeps offload off on this device."""
        device = next(self.ctx.model.parameters()).device
        if not self.ctx.config.offloading.offloads_on(device):
            return None
        if self._link is None:
            self._link = measure_link(device, self.ctx.config.offloading.host_cap_nbytes())
        return self._link

    def solve(
        self, profile: Profile, reserve: int = 0, max_grad_error: float | None = None
    ) -> Policy:
        """The policy for `profile` under the session's budget (keeping `headroom` free, and
        `reserve` bytes below it: what the allocator reserved over the budget, `guard`; adaptive,
        also the room its tracking steps measure codecs in), its blocks' gradient error bounded
        by `max_grad_error` (default: the config's)."""
        c, static = self.ctx.config, self.ctx.static_memory()
        acc, head, codecs = c.run.gradient_accumulation_steps, c.solving.head, c.compression
        budget = self.ctx.budget()
        reserve += self.ctx.oom_reserve_nbytes
        profile.offload = self.offload_link()

        def solve(kept_free: int) -> Policy:
            planned = planned_budget(
                budget, static, profile, c.memory.headroom, acc, head, kept_free
            )
            return solve_policy(
                profile,
                planned,
                static_nbytes=static,
                codecs=codecs.codecs,
                max_rel_error=codecs.max_codec_error,
                max_grad_error=codecs.max_grad_error if max_grad_error is None else max_grad_error,
                solver=c.solving.solver,
                time_limit_s=c.solving.solver_time_limit,
                split_blocks=c.solving.split_blocks,
                accumulation=acc,
                head=head,
            )

        policy, need = solve(reserve), 0
        if (
            c.tracking.adaptive
        ):  # room for the rectifier to re-measure the lossy codecs the plan runs
            cap = tracking_room_cap(budget, static)
            # a plan solved with room kept free may run other codecs, which need more: solved
            # again until the plan keeps what its own tracking step needs (within the cap)
            for _ in range(TRACKING_SOLVES):
                wanted = min(tracking_need(profile, policy), cap)
                need = max(need, wanted)
                peak = policy.metadata.get("predicted", {}).get("peak_nbytes")
                if not wanted or peak is None or budget - reserve - peak >= wanted:
                    break
                policy = solve(reserve + need)
        headroom = headroom_for(profile) if c.memory.headroom is None else c.memory.headroom
        policy.metadata.update(
            budget_spec=str(c.budget), budget_nbytes=budget, headroom=headroom, tracking_nbytes=need
        )
        return policy

    def least_memory(self, profile: Profile) -> Policy:
        """Full recomputation (`least_memory_policy`) for `profile`, labelled with the session's
        budget: what a bucket runs when no other policy fits."""
        c = self.ctx.config
        profile.offload = self.offload_link()
        policy = least_memory_policy(
            profile, self.ctx.static_memory(), c.run.gradient_accumulation_steps, c.solving.head
        )
        policy.metadata.update(budget_spec=str(c.budget), budget_nbytes=self.ctx.budget())
        return self._compiled(policy)

    def solve_measured(
        self,
        profile: Profile,
        probes: dict[str, BlockProbe],
        reserve: int = 0,
        room: int | None = None,
        batch: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Solve; measure and time the action tables the policy uses on the profiled blocks
        (their real transients go into the profile) and their blocks' gradient error, and solve
        again with them, up to twice; the final policy's tables measured too, its predicted added
        time is theirs (`predict`). A measured gradient error above ``max_grad_error`` (the solver
        predicts it from single-op errors in quadrature) scales the bound down by the miss.
        Planned for compile, with the profiled `batch`: the policy's whole step is measured
        compiled too (`_measure_plan`)."""
        bound = self.ctx.config.compression.max_grad_error
        with phase("solve"):
            policy = self.ctx.coordinator.share(lambda: self.solve(profile, reserve, bound))
        for attempt in range(3 if probes else 0):
            new = self._measure_tables(profile, probes, policy, room)
            with self.ctx.own_forwards(), phase("policy_error"):
                err = policy_block_error(probes, policy, self.ctx.autocast) if bound else 0.0
            policy.metadata["measured_grad_error"] = err
            limit = self.ctx.config.compression.max_grad_error
            if limit is not None and bound and err > 1.05 * limit and attempt < 2:
                bound, new = bound * limit / err, True
            if not new or attempt == 2:
                break
            with phase("solve"):
                policy = self.ctx.coordinator.share(lambda b=bound: self.solve(profile, reserve, b))
        if probes:
            if batch is not None:
                self._measure_plan(profile, batch, self._compiled(policy), room)
                policy = self._use_slack(profile, probes, batch, policy, reserve, room, bound)
            policy = self._within_budget(profile, probes, policy, reserve, room)
        return self._compiled(policy)

    def _measure_tables(
        self, profile: Profile, probes: dict[str, BlockProbe], policy: Policy, room: int | None
    ) -> int:
        """Measure and time the action tables `policy` runs on the profiled blocks (their real
        transients go into `profile`); how many were new."""
        c = self.ctx.config
        with self.ctx.own_forwards(), phase("action_tables"):
            return measure_policy(
                profile,
                probes,
                policy,
                self.ctx.autocast,
                c.solving.profile_repeats,
                room,
                c.compilation.compile,
            )

    def _measure_plan(
        self, profile: Profile, batch: Mapping[str, Any], policy: Policy, room: int | None
    ) -> None:
        """Planned for compile, `policy`'s whole step measured compiled on `batch`
        (`profiler.compiled.measure_plan`): its prediction then holds what the compiled graph
        saves around its tags. Skipped where its step is predicted not to fit `room` (the bytes
        profiling may add) or the profile has no compiled whole step (its plan stays predicted
        from the parts, the residuals' conservative side)."""
        if not self.ctx.config.compilation.compile or "full_phases" not in profile.compiled:
            return
        acc, static = self.ctx.config.run.gradient_accumulation_steps, self.ctx.static_memory()
        adds = predict(profile, policy, static, acc).peak_nbytes - static.total
        if room is not None and adds > room:
            return
        with self.ctx.own_forwards(), phase("compiled_plan"):
            measure_plan(profile, unwrap_model(self.ctx.model), batch, self.ctx.autocast, policy)

    def _compiled(self, policy: Policy) -> Policy:
        """`policy` labelled with the backend it was planned for (its blocks then run their
        compile contexts without warning of an eager plan)."""
        if self.ctx.config.compilation.compile:
            policy.metadata["compile"] = self.ctx.config.compilation.compile
        return policy

    def _use_slack(
        self,
        profile: Profile,
        probes: dict[str, BlockProbe],
        batch: Mapping[str, Any],
        policy: Policy,
        reserve: int,
        room: int | None,
        bound: float | None,
    ) -> Policy:
        """Measured compiled (`_measure_plan`), a plan often holds less than it was solved to:
        the solver counts every kept output, the compiled graph saves those backward reads
        (gpt2-cpu at a quarter of the way: 150.5 of 170.4 MiB). Where that leaves more than
        `SLACK` of the activation share, solve once more as if every plan had this one's
        residual, measure the new plan's tables and whole step compiled, and keep it only where
        all ranks measured it within the limit and faster. The compiled headroom stays: a model
        compiled block by block (`layer.compile()`) holds up to 1.1 % more than the step
        measured compiled whole (llama-cpu; solved into that headroom, 215.8 MiB against a
        213.9 MiB budget)."""
        measured = profile.compiled.get("plans", {}).get(plan_key_of(profile, policy))
        if measured is None:
            return policy
        acc, static = self.ctx.config.run.gradient_accumulation_steps, self.ctx.static_memory()
        limit = self.ctx.limit(reserve)
        first = predict(profile, policy, static, acc)
        top = self.ctx.coordinator.agree((first.peak_nbytes,))[0]
        if limit - top < SLACK * (limit - static.total):
            return policy
        generic = {k: profile.compiled.get(k) for k in ("residual", "residual_plain")}
        profile.compiled.update(residual=list(measured), residual_plain=list(measured))
        try:
            with phase("solve"):
                other = self.ctx.coordinator.share(lambda: self.solve(profile, reserve, bound))
        finally:
            profile.compiled.update(generic)
        other_key = plan_key_of(profile, other)
        if other_key == plan_key_of(profile, policy):
            return policy
        self._measure_tables(profile, probes, other, room)
        self._measure_plan(profile, batch, self._compiled(other), room)
        second = predict(profile, other, static, acc)
        unmeasured = other_key not in profile.compiled.get("plans", {})
        slower = int(unmeasured or second.added_ms >= first.added_ms)  # unmeasured: no margin
        top, slower = self.ctx.coordinator.agree((second.peak_nbytes, slower))
        keep = top <= limit and not slower
        logger.debug(
            "adacc: compiled plan solved again into its slack: %s, %.1f ms -> %s, %.1f ms%s; %s",
            fmt_bytes(first.peak_nbytes),
            first.added_ms,
            fmt_bytes(second.peak_nbytes),
            second.added_ms,
            " (not measured whole)" if unmeasured else "",
            "kept" if keep else "the first kept",
        )
        return other if keep else policy

    def _within_budget(
        self,
        profile: Profile,
        probes: dict[str, BlockProbe],
        policy: Policy,
        reserve: int,
        room: int | None,
    ) -> Policy:
        """`policy` predicted anew with every table it runs measured (the last ones are measured
        after the last solve: their real transients can move the peak by some KiB); above the
        budget, solved once more below it by the excess, else full recomputation. As in
        `planned_budget`, a reserve never pushes the limit under full recomputation's peak where
        the budget itself holds that; a `BudgetError` where it does not (the caller decides, as
        for a solve that fails). Every rank decides on the largest of their predictions, so they
        solve (a collective) alike."""
        acc, static, budget = (
            self.ctx.config.run.gradient_accumulation_steps,
            self.ctx.static_memory(),
            self.ctx.budget(),
        )
        limit = budget - reserve - self.ctx.oom_reserve_nbytes
        final = predict(profile, policy, static, acc)
        top = self.ctx.coordinator.agree((final.peak_nbytes,))[0]
        if top > limit:
            # full recomputation's peak: the floor a reserve cannot push the limit under
            least = self.least_memory(profile)
            least_final = predict(profile, least, static, acc)
            floor = self.ctx.coordinator.agree((least_final.peak_nbytes,))[0]
            limit = max(limit, min(budget, floor))
            if top > limit:
                try:
                    with phase("solve"):
                        excess = reserve + top - limit
                        policy = self.ctx.coordinator.share(lambda: self.solve(profile, excess))
                except AdaccError:  # nothing fits below the excess (the leader's BudgetError)
                    fits = False
                else:
                    self._measure_tables(profile, probes, policy, room)
                    final = predict(profile, policy, static, acc)
                    fits = self.ctx.coordinator.agree((final.peak_nbytes,))[0] <= limit
                if not fits:
                    if floor > limit:
                        raise BudgetError(
                            f"no policy fits {fmt_bytes(limit)} once its action tables are "
                            f"measured: full recomputation needs {fmt_bytes(floor)}; raise the "
                            "budget or shorten the batch"
                        )
                    policy, final = least, least_final
        pred = policy.metadata.setdefault("predicted", {})
        if "added_ms" in pred:
            pred["ops_added_ms"] = pred["added_ms"]  # the per-op sums the solver compared
        pred.update(added_ms=final.added_ms, peak_nbytes=final.peak_nbytes, moment=final.moment)
        return policy
