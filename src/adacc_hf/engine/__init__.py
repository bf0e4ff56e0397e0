"""The engine: framework-neutral planning, patching and tracking of a training run.

`session.AdaccSession` holds the parts, each an object with its own state around one
`context.SessionContext`: `profiles` (a bucket's profile: measured, interpolated or saved),
`solving` (a profile solved under the budget, its tables measured), `planner` (bucket -> plan),
`tracking` (the rectifier; out-of-memory recovery with `oom` and `retry`), `guard` (reserved
memory, interpolated buckets checked). Beside them: `config` (the options: the budget, the groups
of `options` and the facts of the run, `facts`, read off it with `sharding`), `shapes` (buckets of
batch shapes), `coordinator` (who decides across ranks), `autobatch` (the micro-batch), `saved`
(profiles on disk), `plans` (what a session plans and reports). `integrations` adapts it to
Trainer, TRL and Accelerate.
"""

from .config import AdaccConfig
from .coordinator import Coordinator, DistributedCoordinator, coordinator_for_process
from .facts import RunFacts
from .options import (
    CodecOptions,
    CompileOptions,
    MemoryOptions,
    OffloadOptions,
    SolverOptions,
    TrackingOptions,
)
from .plans import AdaccEvent, Plan
from .session import AdaccSession

__all__ = [
    "AdaccConfig",
    "AdaccEvent",
    "AdaccSession",
    "CodecOptions",
    "CompileOptions",
    "Coordinator",
    "DistributedCoordinator",
    "MemoryOptions",
    "OffloadOptions",
    "Plan",
    "RunFacts",
    "SolverOptions",
    "TrackingOptions",
    "coordinator_for_process",
]
