"""End to end, prediction against measurement: over a sweep of budgets, every solved policy holds
no more than the budget's activation share, within 5 % of the prediction, and costs less time as
the budget grows; a budget that fits everything checkpoints nothing."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.sweep import budget_sweep


def test_budget_sweep_memory_fits_and_matches_prediction(tiny):
    model, batch = tiny
    rows = budget_sweep(model, batch, points=5, repeats=2)
    for r in rows:
        assert r.measured_nbytes <= r.share_nbytes, r
        assert abs(r.error) <= 0.05, r
    times = [r.added_ms for r in rows]
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(times)), times
    assert rows[-1].checkpointed_blocks == 0 and rows[-1].added_ms == 0
    assert rows[0].checkpointed_blocks > 0
