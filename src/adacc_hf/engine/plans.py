"""What a session plans and reports: one `Plan` per bucket of batch shapes, and `AdaccEvent`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policy import Policy
from ..schema import Profile
from .shapes import ShapeKey

__all__ = ["AdaccEvent", "Plan"]


@dataclass
class AdaccEvent:
    """Something worth logging: a new plan, a switch, or a tracking step."""

    step: int
    kind: str  # "policy" | "switch" | "track" | "batch" (the automatic micro-batch) | "guard"
    policy: Policy | None = None
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    """The policy of one bucket of batch shapes (``key`` None: every shape), and its profile."""

    key: ShapeKey | None
    policy: Policy
    profile: Profile | None = None
    stale: bool = False  # codec statistics moved since it was solved: re-solve before next use
    # Bytes kept free below the budget beyond the step model's prediction: what CUDA's allocator
    # reserved above the budget when this bucket ran (`guard`).
    reserve_nbytes: int = 0
