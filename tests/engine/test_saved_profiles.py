"""A run started again plans from the profiles the last one saved (issue 32): no profiling where
the fingerprint holds (counted as the blocks' forwards, not from the session's own record), the
same plans, every step within the budget; a run measured otherwise profiles anew and says what
differs."""

from __future__ import annotations

import logging

import pytest
import torch
from test_entry_points import (
    LONG,
    QUICK,
    SHORT,
    TRAINER,
    Sequence,
    long_budget,
    loop_metered,
    tiny,
    train_metered,
)
from transformers import Trainer, TrainingArguments

from adacc_hf import AdaccCallback, AdaccSession, AdaccTrainingArguments, prepare
from adacc_hf.engine.patch import owner_of
from adacc_hf.engine.saved import PROFILES_FILE, read_profiles
from adacc_hf.errors import AdaccError, PolicyError
from adacc_hf.integrations import write_artifacts

#: The first MLP's forwards of the two steps without profiling: each step's forward and its
#: recompute, one forward per bucket to find the blocks (profiling runs it 90 times or so).
REUSED = 8


class BlockCalls:
    """Counts forwards of the first decoder layer's MLP (profiling runs it dozens of times)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        mlp = model.model.layers[0].mlp
        self.handle = mlp.register_forward_pre_hook(lambda *a: self._count())

    def _count(self) -> None:
        self.n += 1


def run(tmp_path, profile_from: str | None = None) -> tuple[AdaccSession, list[int], int, int]:
    """The entry-point tests' loop (short batch, then long) under `prepare`; returns the session,
    the step peaks, the budget and the first MLP's forwards."""
    model, short, long = tiny()
    budget = long_budget(model, long, "adamw_torch")
    calls = BlockCalls(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    extra = {"profile_from": profile_from} if profile_from else {}

    def start(batch):
        return prepare(model, budget, batch, optimizer="adamw_torch", **QUICK, **extra)

    session, peaks = loop_metered(model, opt, start, [short, long])
    calls.handle.remove()
    return session, peaks, budget, calls.n


@pytest.mark.slow  # every entry point does it in tests/integrations/test_entry_point_parity.py
def test_a_run_started_again_plans_from_the_saved_profiles(tmp_path, caplog):
    first, peaks, budget, calls = run(tmp_path)
    write_artifacts(str(tmp_path), first)
    saved = read_profiles(str(tmp_path / PROFILES_FILE))
    assert {p.fingerprint["bucket"] for p in saved} == {"2 x 16", "2 x 64"}
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        again, peaks2, budget2, calls2 = run(tmp_path, str(tmp_path))
    print(f"first MLP's forwards: {calls} profiling, {calls2} from the saved profiles")
    assert caplog.text.count("planned from") == 2, caplog.text
    assert calls2 <= REUSED < calls, (calls, calls2)
    for key in (SHORT, LONG):
        assert again.plans[key].policy.fingerprint() == first.plans[key].policy.fingerprint()
    assert budget2 == budget and max(peaks + peaks2) <= budget, (peaks, peaks2, budget)


def test_a_profile_measured_otherwise_is_measured_anew(tmp_path, caplog):
    first, _, _, calls = run(tmp_path)
    write_artifacts(str(tmp_path), first)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with caplog.at_level(logging.INFO, logger="adacc_hf"):
            _, _, _, calls2 = run(tmp_path, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert "planned from" not in caplog.text
    assert caplog.text.count("was measured otherwise") == 2, caplog.text
    assert f"device: cpu ({threads} threads) -> cpu ({threads + 1} threads)" in caplog.text
    assert calls2 > REUSED, (calls, calls2)


def test_the_trainer_reuses_what_its_last_run_saved_in_output_dir(tmp_path, caplog):
    model, _, long = tiny()
    budget = long_budget(model, long, "adamw_torch_fused")

    def train() -> list[int]:
        model, short, long = tiny()
        trainer = Trainer(
            model=model,
            args=TrainingArguments(output_dir=str(tmp_path), **TRAINER),
            train_dataset=Sequence(short, long),
            callbacks=[AdaccCallback(budget=budget, **QUICK)],
        )
        return train_metered(trainer, model)

    train()
    assert (tmp_path / PROFILES_FILE).exists()
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        peaks = train()
    assert caplog.text.count("planned from") == 2, caplog.text
    assert max(peaks) <= budget, (peaks, budget)


def test_a_missing_profile_path_is_an_error_before_any_work():
    with pytest.raises(AdaccError, match="profile_from: no such file"):
        AdaccTrainingArguments(output_dir="out", adacc=True, adacc_profile_from="/no/such/dir")


def test_unreadable_saved_profiles_are_an_error_where_named_and_skipped_where_looked_for(
    tmp_path, caplog
):
    (tmp_path / PROFILES_FILE).write_text("[{not json")
    with pytest.raises(PolicyError, match="cannot read saved profiles"):
        prepare(tiny()[0], "1GiB", profile_from=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        assert read_profiles(str(tmp_path), strict=False) == []
    assert "ignoring the saved profiles" in caplog.text


def test_a_forward_under_another_autocast_does_not_take_the_fp32_profile(tmp_path, caplog):
    """Planned from a saved fp32 profile, then trained under bf16: the bf16 plan is measured under
    bf16 (an fp32 profile's ops would not be the ones the bf16 forward runs)."""
    model, short, long = tiny()
    budget = long_budget(model, long, "adamw_torch")
    write_artifacts(str(tmp_path), prepare(model, budget, short, **QUICK))
    owner_of(model).close()
    model, short, _ = tiny()
    session = prepare(model, budget, short, profile_from=str(tmp_path), **QUICK)
    assert session.current.profile.autocast is None
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**short).loss
        loss.backward()
    session.close()
    assert "autocast: None -> torch.bfloat16" in caplog.text, caplog.text
    assert session.current.profile.autocast == str(torch.bfloat16)
