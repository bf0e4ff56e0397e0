"""End to end, prediction against measurement: for budgets from full recomputation's step peak to
no checkpointing's, families x {fp32, bf16 autocast} x {one shape, dynamic padding over 8x
lengths with the first batch the shortest}, every training step's measured peak
(`measure_step_peak`) stays within the budget, the prediction for a batch as long as its bucket is
within 5 % of the measurement, no op of the run is unknown to its policy, and the ample budget's
plan is the cheapest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adacc_hf import assets
from benchmarks.harness.sweep import budget_sweep

LAYERS = {"t5": {"num_layers": 4, "num_decoder_layers": 4}, "gpt2": {"n_layer": 4}}
DYNAMIC = [16, 64, 32, 128, 48]  # 8x from the first (shortest) to the longest
FIXED = [64, 64]
# Two families in the default run (dynamic padding with a measured step per bucket runs in
# tests/integrations/test_trainer.py, bf16 included); the rest (T5: minutes) is `slow`.
DEFAULT = {
    ("llama", "fp32", "fixed"),
    ("bert", "fp32", "fixed"),
}
CASES = [
    pytest.param(f, d, s, marks=() if (f, d, s) in DEFAULT else pytest.mark.slow)
    for f in ("llama", "gpt2", "t5", "bert")
    for d in ("fp32", "bf16")
    for s in ("fixed", "dynamic")
]


@pytest.mark.parametrize(("family", "dtype", "shapes"), CASES)
def test_step_peak_stays_within_budget_and_near_the_prediction(family, dtype, shapes):
    def make():
        return assets.tiny_model(family, **LAYERS.get(family, {"num_hidden_layers": 4}))

    lengths = DYNAMIC if shapes == "dynamic" else FIXED
    model = make()
    batches = [
        assets.tiny_batch(family, model, batch_size=4, seq_len=n, seed=i)
        for i, n in enumerate(lengths)
    ]
    autocast = torch.bfloat16 if dtype == "bf16" else None
    rows = budget_sweep(make, batches, points=3, autocast=autocast)
    assert rows
    for r in rows:
        assert r.measured_nbytes <= r.budget_nbytes, r
        assert r.unknown_ops == 0, r
        if r.at_edge:  # the prediction is for exactly this shape: within 5 %
            assert abs(r.error) <= 0.05, r
    per_budget: dict[int, float] = {}
    for r in rows:
        if r.shape == list(batches[-1]["input_ids"].shape):
            per_budget[r.budget_nbytes] = r.added_ms
    times = [per_budget[b] for b in sorted(per_budget)]
    # Each budget's run profiles a fresh model and calibrates op times against measured block
    # steps, so neighbouring budgets' plans are priced by different profiles (seen 26 vs 35 ms on
    # a loaded CPU): only the ample end is checked here, as the cheapest. On one profile the added
    # time never grows with the budget (`test_solver.test_added_time_never_grows_with_the_budget`).
    # No plan is faster than no checkpointing (added 0): another profile's calibration noise can
    # price one below it (seen -3.5 ms), which the ample end's 0 still matches.
    assert times[-1] <= max(min(times), 0.0), times
    if shapes == "dynamic":  # short batches get their own, cheaper plans
        first = next(r for r in rows if r.shape[1] == lengths[0])
        longest = next(
            r for r in rows if r.shape[1] == max(lengths) and r.budget_nbytes == first.budget_nbytes
        )
        assert first.predicted_nbytes < longest.predicted_nbytes
