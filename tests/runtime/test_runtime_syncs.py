"""A training step under Adacc never makes the host wait for the device: no more host-sync ops
(``.item()``, ``bool(tensor)``, ``nonzero``, boolean indexing, ``equal``, device-to-host
copies, ...) than the unpatched model, under every codec, on the step that builds the slot
tables, on ordinary steps and on tracking steps. Counted by a dispatch mode (`sync_count`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sync_count import SyncCounter

from adacc_hf import apply_adacc, trace_model
from adacc_hf.evolution import OutlierTracker
from adacc_hf.policy import builders
from adacc_hf.schema import (
    Action,
    CodecProfile,
    GroupProfile,
    OpProfile,
    Profile,
    codec_candidates,
)

CODECS = ["int4_outlier", "int4_channel", "int4_asym", "int4_naive", "fp8_e4m3"]


def _policy(trace, codec: str):
    """Every output autograd saves compressed with `codec` (masks bit-packed)."""

    def choose(op):
        names = codec_candidates(op)
        if not op.saved or not names:
            return Action.recompute()
        return Action.compress("bitpack" if names == ["bitpack"] else codec)

    return builders.from_trace(trace, choose, source=f"test:{codec}")


def _profile(trace, codec: str) -> Profile:
    """A profile naming, for every cacheable op, the codecs the tracker re-measures (sizes are not
    needed by the tracker; each codec is faster than recomputing its op, so it is measured)."""
    groups = {}
    for name, bt in trace.groups.items():
        ops = []
        for op in bt.ops:
            prof = replace(OpProfile.from_spec(op), fwd_ms=1.0)
            names = codec_candidates(op, None if op.mask else [codec])
            if op.cacheable:
                for n in names:
                    prof.codecs[n] = CodecProfile(n, {}, 0, 0.0, 0.0, 0.0)
            ops.append(prof)
        groups[name] = GroupProfile(name, bt.num_blocks, 0, 0, 0.0, 0, 0.0, ops=ops)
    return Profile(
        trace.model_type, trace.adapter, trace.adapter_version, "cpu", "fp32", {}, groups, 0
    )


def _step(model, batch):
    torch.manual_seed(0)
    model(**batch).loss.backward()


@pytest.mark.parametrize("codec", CODECS)
def test_a_training_step_adds_no_host_syncs_under_any_codec(tiny, codec):
    model, batch = tiny
    with SyncCounter() as plain:
        _step(model, batch)
    trace = trace_model(model, batch)
    policy = _policy(trace, codec)
    with apply_adacc(model, policy) as handle:
        with SyncCounter() as first:  # builds every block's slot table
            _step(model, batch)
        with SyncCounter() as ordinary:
            _step(model, batch)
        tracker = OutlierTracker(_profile(trace, codec))
        handle.set_tracker(tracker)
        with SyncCounter() as tracking:
            _step(model, batch)
        handle.set_tracker(None)
        assert sum(handle.cached_bytes().values()) > 0 and not handle.problems
    assert first.ops == ordinary.ops == tracking.ops == plain.ops
    stats = tracker.stats  # read in one transfer after the step
    assert stats, "the tracking step measured nothing"
    assert all(s.n >= 1 and s.rel_error >= 0 for s in stats.values())


def test_the_sync_counter_sees_what_the_old_runtime_did():
    """The counter is not blind: the finiteness check and the outlier selection this runtime used
    to run on the hot path each count."""
    from adacc_hf.codecs import get_codec, payload_finite

    x = torch.randn(8, 64)
    enc = get_codec("int4_naive").encode(x)
    with SyncCounter() as c:
        payload_finite(enc)  # bool(torch.isfinite(t).all()) per payload tensor
        torch.nonzero(x.abs().sum(0) > 3)  # the old outlier selection
        _ = x[x > 0]  # boolean indexing (the old bitpack scale)
    assert c.ops["aten._local_scalar_dense.default"] >= 1
    assert c.ops["aten.nonzero.default"] == 1 and c.ops["aten.index.Tensor"] == 1
