"""Profiling a bucket for `AdaccSession`: the room it may use, the profile measured (op costs
scaled from the nearest profiled bucket; memory measured, or interpolated from a measured bucket
that contains it and one it contains, at least the tiny bucket: `profiler.derive`), or reused from
what an earlier run saved where its fingerprint is this run's (`profiler.fingerprint`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..adapters.plain import plain_model
from ..profiler import BlockProbe, capture_probes, profile_model
from ..profiler.derive import chord_excess, contains, interpolate_memory, length_share, ratio
from ..profiler.fingerprint import differences, run_fingerprint
from ..profiler.memory import sharded
from ..profiler.room import profiling_room
from ..runtime.peak import storage_nbytes
from ..schema import Profile
from ..units import fmt_bytes
from .context import SessionContext
from .saved import read_profiles
from .shapes import ShapeKey, derivable, key_text, key_tokens, tiny_batch, tiny_key

logger = logging.getLogger("adacc_hf")

#: The share of its step an interpolated bucket's prediction may over-count by its chord
#: (attention's quadratic parts) before its memory is measured instead.
LOOSE = 0.02


def serves(profile: Profile, head: str) -> bool:
    """Whether `profile` measured what a run with LM head option `head` chooses from: one made
    for the model's own head alone (``"full"``) has no other head's costs."""
    return head == "full" or profile.fingerprint.get("heads") != "full"


class ProfileStore:
    """A session's profiles by bucket: measured, interpolated, or reused from a saved run.

    Args:
        ctx: the session's shared state.
        profiles: profiles by bucket to start from (shared by sessions of the same model: a
            benchmark's budgets).
    """

    def __init__(
        self, ctx: SessionContext, profiles: dict[ShapeKey, Profile] | None = None
    ) -> None:
        self.ctx = ctx
        self.profiles: dict[ShapeKey, Profile] = profiles if profiles is not None else {}
        # Profiles saved by an earlier run (`reuse_profiles`), used where their fingerprint holds.
        self.saved_profiles: list[Profile] = []
        self._saved_source = ""
        # buckets whose interpolated memory a step disproved (`guard.DerivedCheck`): measured
        self.full_memory: set[ShapeKey] = set()
        source = ctx.config.tracking.profile_from
        if source not in (None, "none"):
            self.reuse_profiles(read_profiles(source), source)

    def profile_bucket(
        self, batch: Mapping[str, Any], key: ShapeKey, room: int | None
    ) -> tuple[Profile, dict[str, BlockProbe]]:
        """`key`'s profile, saved or measured now, and the profiled blocks with their inputs."""
        probes: dict[str, BlockProbe] = {}
        saved = self._saved_profile(key)
        if saved is not None and saved.memory_from and key in self.full_memory:
            saved = None
        if saved is None:
            profile = self.profiles[key] = self._profile(batch, key, probes, room)
            return profile, probes
        self.profiles[key] = saved
        with self.ctx.own_forwards():  # the blocks its action tables are timed on: one forward
            probes = capture_probes(
                self.ctx.model, self.ctx.padded(batch, key), saved, self.ctx.autocast
            )
        return saved, probes

    def profiling_room(self, batch: Mapping[str, Any]) -> int:
        """The bytes profiling may add now within the budget, less the device reserve learnt
        from out-of-memory errors (`profiler.room`)."""
        s = self.ctx.static_memory()
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        budget = self.ctx.budget() - self.ctx.oom_reserve_nbytes
        room = profiling_room(self.ctx.model, budget, tensors, s.optimizer + s.master_weights)
        # every rank skips the same runs (each run all-gathers parameters under ZeRO-3 / FSDP)
        return -self.ctx.coordinator.agree((-room,))[0]

    def _profile(
        self,
        batch: Mapping[str, Any],
        key: ShapeKey,
        probes: dict | None = None,
        room: int | None = None,
    ) -> Profile:
        """Profile `batch` padded to `key`'s edge, within `room` bytes less the padded copy. Op
        costs scale from the nearest profiled bucket when there is one; memory is measured, or
        interpolated (`profiler.derive`) between the largest measured bucket it contains (the
        tiny one, measured the first time, where no other) and the smallest that contains it."""
        sample = self.ctx.padded(batch, key)
        alike = [(k, p) for k, p in self.profiles.items() if k[-1] == key[-1]]  # same masking
        near = min(
            alike, key=lambda kv: abs(key_tokens(kv[0]) - key_tokens(key)), default=(None, None)
        )[1]
        # a sharded model's backward is estimated from what it holds (`memory.estimate`), not
        # measured: the chord's bound holds for measured levels only
        derive = (
            key not in self.full_memory
            and derivable(batch)
            and not sharded(self.ctx.model)
            and plain_model(self.ctx.model) is None  # its batches cannot be cut to the tiny bucket
        )
        outer = self._outer(key) if derive else None
        if self.ctx.coordinator.leader:
            logger.info(
                "adacc: profiling bucket %s (one block per group, %d timed runs per op%s)...",
                key_text(key),
                self.ctx.config.solving.profile_repeats,
                f"; memory from {key_text(outer)}" if outer else "",
            )
        if outer is None:
            profile = self._run_profile(sample, near, probes, room)
        else:
            low = self._inner(key)
            if low is None:  # the tiny bucket, measured the first time
                low, pad = tiny_key(key), self.ctx.pad_id()
                tiny = self._run_profile(
                    tiny_batch(batch, key, pad), self.profiles[outer], None, room
                )
                tiny.fingerprint["bucket"] = key_text(low)
                self.profiles[low] = tiny
            profile = self._run_profile(sample, near, probes, room, memory=False)
            shapes = (low[:-1], outer[:-1], key[:-1])
            lo, hi = self.profiles[low], self.profiles[outer]
            r, length = ratio(*shapes), length_share(*shapes)
            excess = chord_excess(lo, hi, profile, r, length)
            if excess > self._loose_nbytes(lo):  # attention's quadratic parts: measure instead
                if self.ctx.coordinator.leader:
                    logger.info(
                        "adacc: bucket %s: memory measured (the chord from %s to %s over-counts "
                        "its blocks' outputs by %s)",
                        key_text(key), key_text(low), key_text(outer), fmt_bytes(excess),
                    )  # fmt: skip
                profile = self._run_profile(sample, near, probes, room)
            else:
                scale = key_tokens(key) / key_tokens(outer)
                interpolate_memory(profile, lo, hi, r, scale, length)
                profile.memory_from = [key_text(low), key_text(outer)]
        profile.fingerprint["bucket"] = key_text(key)
        return profile

    def _loose_nbytes(self, low: Profile) -> int:
        """The most an interpolated bucket's chord may over-count (`derive.chord_excess`):
        `LOOSE` of the least its step can peak at (static memory and what full recomputation
        holds at `low`, a bucket it contains), so its prediction stays within a few % of the
        step; past it the bucket's memory is measured."""
        return int(LOOSE * (self.ctx.static_memory().total + low.full_recompute_nbytes()))

    def measure_in_full(self, key: ShapeKey) -> None:
        """Forget `key`'s profile: measure its memory anew before its next batch (a step of it
        allocated more than its interpolated memory predicted: `guard.DerivedCheck`)."""
        self.full_memory.add(key)
        self.profiles.pop(key, None)

    def _measured(self, key: ShapeKey) -> list[ShapeKey]:
        """Buckets of `key`'s masking whose memory was measured (not interpolated)."""
        return [k for k, p in self.profiles.items() if k[-1] == key[-1] and not p.memory_from]

    def _inner(self, key: ShapeKey) -> ShapeKey | None:
        """The largest bucket with measured memory that `key` contains (the tiny one at least,
        once measured): the low end of the chord."""
        found = [k for k in self._measured(key) if k != key and contains(key[:-1], k[:-1])]
        return max(found, key=key_tokens, default=None)

    def _outer(self, key: ShapeKey) -> ShapeKey | None:
        """The smallest bucket with measured memory that contains `key` (same masking, every
        dimension at least as large), if any."""
        found = [
            k for k in self._measured(key) if k != tiny_key(key) and contains(k[:-1], key[:-1])
        ]
        return min(found, key=key_tokens, default=None)

    def _run_profile(
        self,
        sample: Mapping[str, Any],
        near: Profile | None,
        probes: dict | None,
        room: int | None,
        memory: bool = True,
    ) -> Profile:
        # On every rank: under ZeRO-3 / FSDP these forwards all-gather parameters.
        with self.ctx.own_forwards():
            return profile_model(
                self.ctx.model,
                sample,
                codecs=self.ctx.config.compression.codecs,
                codec_params=self.ctx.config.compression.codec_params(),
                repeats=self.ctx.config.solving.profile_repeats,
                autocast=self.ctx.autocast,
                reference=near,
                probes=probes,
                room=None if room is None else max(0, room - storage_nbytes(sample.values())),
                head=self.ctx.config.solving.head,
                memory=memory,
                compile=self.ctx.config.compilation.compile,
                codec_backends=self.ctx.config.compression.codec_backends,
            )

    def reuse_profiles(self, profiles: list[Profile], source: str) -> None:
        """Plan from these saved profiles (an earlier run's ``adacc_profiles.json``) where one's
        fingerprint is this run's for the bucket; the rest are profiled anew."""
        self.saved_profiles = list(profiles)
        self._saved_source = source

    def _saved_profile(self, key: ShapeKey) -> Profile | None:
        """The saved profile of `key`'s bucket measured as this run would measure it, on every
        rank (profiling runs collectives on a sharded model, so all ranks profile or none; a rank
        that found no saved profiles, e.g. on a node without the shared directory, still votes)."""
        now: dict[str, str] = {"bucket": key_text(key)}
        bucket: list[Profile] = []
        if self.saved_profiles:  # this run's now: the autocast may have moved (`follow_autocast`)
            c = self.ctx.config
            run = run_fingerprint(
                self.ctx.model,
                self.ctx.autocast,
                c.compression.codecs,
                c.compression.codec_params(),
                c.compilation.compile,
                c.compression.codec_backends,
            )
            now = {**run, "heads": c.solving.head, **now}
            bucket = [
                p for p in self.saved_profiles if p.fingerprint.get("bucket") == now["bucket"]
            ]
        match = next((p for p in bucket if p.fingerprint == now), None)
        if self.ctx.coordinator.agree((int(match is None),))[0]:
            if bucket and self.ctx.coordinator.leader:
                logger.info(
                    "adacc: the saved profile of bucket %s (%s) was measured otherwise; profiling "
                    "anew (%s)",
                    now["bucket"],
                    self._saved_source,
                    "; ".join(differences(bucket[-1].fingerprint, now)),
                )
            return None
        if self.ctx.coordinator.leader:
            logger.info("adacc: bucket %s planned from %s", now["bucket"], self._saved_source)
        return match
