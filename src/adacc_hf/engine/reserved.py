"""`ReservedFit`: a bucket's plan solved until what CUDA's caching allocator would reserve for its
step fits the budget, before the step runs.

Where the allocator is modelled (``allocator``: on CUDA as it is configured, or as an option
says), each new plan's training step is run dry on a host mirror of the model and its allocations
replayed through the allocator's model (`devices.live`). Where the reserved peak passes the budget,
the bucket is solved again keeping free what the allocator reserved above the plan's allocated
peak (and a margin), up to `TRIES` times, as `devices.plan` does for a GPU on paper. What the
model misses, the guard reads off the device after the step (`guard.ReservedGuard`).

Not modelled (the guard alone): sharded or several-rank runs (each rank's allocations are not the
mirror's), compiled plans (the dry step runs eagerly), plans that offload (their host buffers
would count as device memory), and models the mirror cannot copy (`devices.live.mirror_of`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..adapters import unwrap_model
from ..errors import AdaccError
from ..policy import Policy
from ..runtime.allocator import expandable_now
from ..schema import Profile
from .context import SessionContext
from .guard import MARGIN
from .shapes import ShapeKey
from .solving import BucketSolver

__all__ = ["TRIES", "ReservedFit", "allocator_modelled"]

logger = logging.getLogger("adacc_hf")

#: Solves after the first at most, each keeping the last one's reserved gap free.
TRIES = 3


def allocator_modelled(option: str, device: torch.device) -> str | None:
    """The allocator a session's plans are fitted to (``"expandable"`` / ``"default"``), from
    its ``allocator`` option on `device` (None: none is modelled)."""
    if option == "off":
        return None
    if option == "auto":
        if device.type != "cuda":
            return None
        return "expandable" if expandable_now() else "default"
    return option


class ReservedFit:
    """Fits each new plan's reserved peak under the budget (module docstring)."""

    def __init__(self, ctx: SessionContext, solver: BucketSolver) -> None:
        self.ctx, self.solver = ctx, solver
        self._model: Any = None  # `devices.live.ReservedModel`; False: none for this session

    def _reserved_model(self) -> Any:
        if self._model is None:
            self._model = self._build() or False
        return self._model or None

    def _build(self) -> Any:
        """This session's `devices.live.ReservedModel`, or None where nothing is modelled."""
        c = self.ctx.config
        kind = allocator_modelled(c.memory.allocator, self.ctx.device)
        if kind is None:
            return None
        why = None
        if c.run.world_size > 1 or c.run.fsdp or c.run.zero_stage or c.run.ddp:
            why = "a run of several ranks or sharded"
        elif c.compilation.compile:
            why = "a compiled run"
        if why is not None:
            logger.info("adacc: reserved memory not modelled for %s: the guard is left", why)
            return None
        from ..devices.live import ReservedModel

        model = unwrap_model(self.ctx.model)
        return ReservedModel(model, kind == "expandable", c.run.optimizer, self.ctx.autocast)

    def fit(
        self,
        policy: Policy,
        profile: Profile,
        batch: Mapping[str, Any],
        key: ShapeKey,
        reserve: int,
        room: int | None,
    ) -> tuple[Policy, int]:
        """`policy` (solved for `profile`, the bucket `key` of `batch`, keeping `reserve` free),
        or one solved again until its modelled reserved peak fits; returns it and the reserve it
        was solved with."""
        model = self._reserved_model()
        if model is None or policy.offloads:
            return policy, reserve
        sample, limit = self.ctx.padded(batch, key), self.ctx.limit()
        for attempt in range(TRIES + 1):
            peaks = model.peaks(policy, sample)
            if peaks is None:
                break
            allocated, reserved = peaks
            policy.metadata.setdefault("predicted", {})["reserved_nbytes"] = reserved
            if reserved <= limit or attempt == TRIES:
                break
            kept = max(reserve + MARGIN, reserved - allocated + MARGIN)
            try:
                other = self.solver.solve_measured(profile, {}, kept, room)
            except AdaccError:  # nothing fits below it: the guard is left
                break
            if other.fingerprint() == policy.fingerprint() or other.offloads:
                break
            logger.info(
                "adacc: the plan would reserve %.1f MiB on CUDA's allocator (%.1f MiB allocated, "
                "budget %.1f MiB): solved again with %.1f MiB kept free",
                reserved / 2**20,
                allocated / 2**20,
                limit / 2**20,
                kept / 2**20,
            )
            policy, reserve = other, kept
        return policy, reserve
