"""What every part of a session reads: `SessionContext`.

The session's parts (`profiles.ProfileStore`, `solving.BucketSolver`, `planner.Planner`,
`tracking.Rectifier`, `tracking.OomRecovery`) are objects of their own; this is the one place
they share: the model, the options, the ranks, the autocast plans are made under, the budget and
static memory (computed once), the device reserve learnt from out-of-memory errors, the events to
report and the current optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..adapters.plain import plain_model
from ..runtime.peak import batch_nbytes, live_state_nbytes
from ..runtime.sharded import forwards_without_backward
from ..solver import StaticMemory, estimate_static_memory, parse_budget
from .config import AdaccConfig
from .coordinator import Coordinator
from .guard import DerivedCheck
from .plans import AdaccEvent
from .shapes import ShapeKey, padded

__all__ = ["SessionContext"]


class SessionContext:
    """The state a session's parts share (see the module docstring).

    Args:
        model: the unwrapped model the session plans for.
        config: the session's options.
        coordinator: who decides across ranks.
    """

    def __init__(self, model: nn.Module, config: AdaccConfig, coordinator: Coordinator) -> None:
        self.model = model
        self.config = config
        self.coordinator = coordinator
        self.autocast: torch.dtype | None = config.run.autocast
        self.static: StaticMemory | None = None
        self.budget_nbytes: int | None = None
        # Kept free below the budget by every plan after out-of-memory errors (`oom`).
        self.oom_reserve_nbytes = 0
        self.events: list[AdaccEvent] = []
        self.step = 0
        # A step's interpolated-memory check, abandoned by the session's own forwards.
        self.derived_check = DerivedCheck()
        self.planning = False  # True during the session's own forwards (profiling, measuring)
        # Batches the run's data loader fetches ahead of the one a step runs (set by the
        # callback: `run_facts.batches_fetched_ahead`), counted by `count_batches_ahead`.
        self.loader_ahead = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def static_memory(self) -> StaticMemory:
        """The step's static memory (weights, gradients, optimizer states), computed once."""
        if self.static is None:
            self.static = estimate_static_memory(self.model, **self.config.run.static_options())
        return self.static

    def budget(self) -> int:
        """The budget in bytes, resolved once ("auto" counts the free memory and what the plan
        itself counts, already resident)."""
        if self.budget_nbytes is None:
            resident = live_state_nbytes(self.model)
            self.budget_nbytes = parse_budget(self.config.budget, self.device, resident)
        return self.budget_nbytes

    def count_batches_ahead(self, batch: Mapping[str, Any], key: ShapeKey) -> None:
        """Count the batches the run's data loader holds beyond the step's own in the static
        memory every plan is predicted with (`StaticMemory.batches_ahead`): `loader_ahead` of
        them (accelerate's loaders, every Trainer's: the next batch is fetched before this one is
        yielded), each as large as `batch` padded to bucket `key`, the largest bucket planned
        so far (the run's longest first, where ``max_seq_len`` says it). The collator makes them
        on the host and accelerate moves a batch to the device only as it yields it, so they are
        on the device where the device is the host (a CPU run)."""
        if not self.loader_ahead or self.device.type != "cpu":
            return
        ahead = self.loader_ahead * batch_nbytes(self.padded(batch, key).values())
        static = self.static_memory()
        if ahead > static.batches_ahead:
            self.static = dataclasses.replace(static, batches_ahead=ahead)

    def limit(self, reserve: int = 0) -> int:
        """The bytes a plan may peak at: the budget less `reserve` and the device reserve."""
        return self.budget() - reserve - self.oom_reserve_nbytes

    @contextlib.contextmanager
    def own_forwards(self) -> Iterator[None]:
        """Forwards of the session's own (profiling, measuring): the training-forward hook lets
        them pass, and an FSDP2 model is left between iterations as it was found (inside a
        training forward, its state is left to that step's backward)."""
        self.derived_check.abandon()  # a step's measurement does not nest ours
        self.planning = True
        try:
            with forwards_without_backward(self.model):
                yield
        finally:
            self.planning = False

    def pad_id(self) -> int | None:
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return pad if isinstance(pad, int) else None

    def padded(self, batch: Mapping[str, Any], key: ShapeKey) -> dict[str, Any]:
        """`batch` padded to the edge of bucket `key` (a plain PyTorch model's batches are keyed
        exactly and never padded: `shapes.exact_key`)."""
        if plain_model(self.model) is not None:
            return dict(batch)
        return padded(batch, key, self.pad_id())
