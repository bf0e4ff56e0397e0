"""Who decides in a run of several processes: a `Coordinator` handed to each session.

* `Coordinator` (one process): the session decides alone.
* `DistributedCoordinator` (DDP, DeepSpeed ZeRO, FSDP2): every rank profiles and tracks in
  lockstep (under ZeRO-3 / FSDP the profiling forwards all-gather parameters, so all ranks run them
  together); only the leader (rank ``src``) solves and decides, and `share` hands its policy to
  every rank, so all run the same policy (same `Policy.fingerprint()`) and switch at the same step.
  `merge` folds every rank's tracking statistics (rank order) into one set, identical on all
  ranks. A leader that fails releases the other ranks: they raise instead of waiting forever.

`coordinator_for_process()` picks the right one for the current process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import AdaccError
from ..policy import Policy

if TYPE_CHECKING:
    from ..evolution import CodecStats

    TrackedStats = dict[tuple[str, str, str], CodecStats]

__all__ = [
    "Coordinator",
    "DistributedCoordinator",
    "coordinator_for_process",
    "is_distributed",
    "rank",
    "world_size",
]


def is_distributed() -> bool:
    """True inside an initialised `torch.distributed` process group of two or more ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


class Coordinator:
    """A single process: it leads, shares with nobody and merges nothing."""

    leader: bool = True
    distributed: bool = False

    def share(self, decide: Callable[[], Policy]) -> Policy:
        """The leader's `decide()`, on every rank."""
        return decide()

    def merge(self, stats: TrackedStats) -> TrackedStats:
        """Every rank's tracking `stats` folded into one (identical on every rank)."""
        return stats

    def agree(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The elementwise largest `values` of every rank (a batch's bucket)."""
        return values


class DistributedCoordinator(Coordinator):
    """Rank `src` decides; object collectives hand its policy and everyone's statistics around."""

    distributed = True

    def __init__(self, src: int = 0) -> None:
        if not is_distributed():
            raise AdaccError("DistributedCoordinator needs an initialised process group of >= 2")
        self.src = src
        self.leader = dist.get_rank() == src

    @staticmethod
    def _device() -> torch.device | None:
        """Where object collectives stage their bytes: the current GPU under NCCL, else CPU."""
        if dist.get_backend() == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def broadcast(self, policy: Policy | None) -> Policy:
        """The leader's policy on every rank (others pass None); raises on every rank if the
        leader has none."""
        payload: list[Any] = [policy.to_json() if self.leader and policy is not None else None]
        dist.broadcast_object_list(payload, src=self.src, device=self._device())
        if payload[0] is None:
            raise AdaccError(f"rank {self.src} has no adacc policy to share (see its error above)")
        return policy if self.leader and policy is not None else Policy.from_json(payload[0])

    def share(self, decide: Callable[[], Policy]) -> Policy:
        try:
            policy = decide() if self.leader else None
        except Exception:
            with contextlib.suppress(Exception):
                self.broadcast(None)
            raise
        return self.broadcast(policy)

    def agree(self, values: tuple[int, ...]) -> tuple[int, ...]:
        device = self._device() or torch.device("cpu")
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(int(v) for v in t.tolist())  # once per forward; a tiny collective

    def merge(self, stats: TrackedStats) -> TrackedStats:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, stats)
        merged: TrackedStats = {}
        for rank_stats in gathered:  # rank order
            for key, st in rank_stats.items():
                merged[key] = merged[key].merge(st) if key in merged else st
        return merged


def coordinator_for_process(src: int = 0) -> Coordinator:
    """`DistributedCoordinator` inside a process group of several ranks, else `Coordinator`."""
    return DistributedCoordinator(src) if is_distributed() else Coordinator()
