"""Every entry point gets every feature: `AdaccTrainingArguments` and `AdaccCallback` in a plain
`Trainer`, `AdaccTrainer`, and `prepare` in a custom loop, each driven through the same three runs
of a tiny LLaMA on CPU:

1. **automatic micro-batch and out of memory**: a global batch of 4 rows under a budget below
   what HF's full checkpointing takes at 4 rows and above it at 2 (so the micro-batch chosen is
   below 4, and the global batch is kept through accumulation); from the second step on the
   simulated device (`runtime.capacity.DeviceMeter`) makes every allocation 5 % larger than the
   plan counts and holds only what the plan predicted: the step that runs out is re-planned and
   run again, and the run trains to its last step, every step after the error within the device;
2. **a 4x longer batch later** (2 x 16, then 2 x 64): the long bucket gets its own plan, every
   step metered within the budget, where the short plan run on the long batch does not fit it;
3. **saved profiles reused**: run 2 started again on what it saved: no profiling (counted as the
   first MLP's forwards), the same plans.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_rows import Rows
from step_meter import StepMeter, metered
from test_entry_points import (
    LONG,
    QUICK,
    SHORT,
    TRAINER,
    Sequence,
    check_plans,
    long_budget,
    step_peak,
    tiny,
)
from test_saved_profiles import REUSED, BlockCalls
from transformers import Trainer, TrainerCallback, TrainingArguments

from adacc_hf import (
    AdaccCallback,
    AdaccSession,
    AdaccTrainer,
    AdaccTrainingArguments,
    assets,
    prepare,
)
from adacc_hf.runtime.capacity import DeviceMeter
from adacc_hf.runtime.peak import live_state_nbytes

GLOBAL = 4
ENTRY_POINTS = ["arguments", "callback", "adacc_trainer", "prepare"]
#: Runs 2 and 3 in the default suite: the entry point README says to pick, and `prepare`; the
#: callback and `AdaccTrainer` are the same Trainer run (`make test-all`: 20-25 s each).
SLOW_RESUME = {"callback", "adacc_trainer"}


class Run:
    """One training run through `entry` (`ENTRY_POINTS`): returns the session and step peaks."""

    def __init__(self, entry: str, tmp_path: Any, budget: int, **options: Any) -> None:
        self.entry, self.tmp_path, self.budget, self.options = entry, tmp_path, budget, options

    def trainer(self, model: torch.nn.Module, data: Any, **args: Any) -> Trainer:
        base = {**TRAINER, "output_dir": str(self.tmp_path), **args}
        o = self.options
        if self.entry == "callback":
            cb = AdaccCallback(budget=self.budget, **o)
            return Trainer(
                model=model, args=TrainingArguments(**base), train_dataset=data, callbacks=[cb]
            )
        names = {
            "codecs": "adacc_codecs",
            "profile_repeats": None,
            "adaptive": "adacc_adaptive",
            "auto_batch_size": "adacc_auto_batch_size",
            "profile_from": "adacc_profile_from",
        }
        flags = {names[k]: v for k, v in o.items() if names[k] is not None}
        args_ = AdaccTrainingArguments(adacc=True, adacc_budget=str(self.budget), **flags, **base)
        cls = AdaccTrainer if self.entry == "adacc_trainer" else Trainer
        return cls(model=model, args=args_, train_dataset=data)


def session_of(trainer: Trainer) -> AdaccSession:
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AdaccCallback))
    assert cb.session is not None
    return cb.session


def inflate(meter: DeviceMeter, session: AdaccSession) -> None:
    """From the second step: every allocation 5 % larger on a device holding what the plan of the
    first step predicted (the real step lands on it: exact on CPU)."""
    meter.capacity = session.current.policy.metadata["predicted"]["peak_nbytes"]
    meter.inflate = 1.05


class _Inflate(TrainerCallback):
    """`inflate` after the first optimizer step."""

    def __init__(self, meter: DeviceMeter, trainer: Trainer) -> None:
        self.meter, self.trainer = meter, trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            inflate(self.meter, session_of(self.trainer))


# ------------------------------------------------------------------ 1. micro-batch, out of memory
def _hf_full_peak(model: torch.nn.Module, batch: dict, rows: int) -> int:
    """HF full checkpointing's step peak at `rows` rows with the accumulation that keeps the
    global batch (the micro-batches alive together, as the Trainer holds them; states exist)."""
    from test_autobatch import _peak

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        return _peak(model, batch, rows, GLOBAL // rows, opt, hf=True)
    finally:
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_auto_micro_batch_and_out_of_memory(entry, tmp_path, caplog):
    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    sample = assets.tiny_batch("llama", model, batch_size=GLOBAL, seq_len=48)
    two, four = _hf_full_peak(model, sample, 2), _hf_full_peak(model, sample, 4)
    budget = two + (four - two) * 4 // 5
    options = dict(codecs=[], profile_repeats=1, adaptive=False, auto_batch_size=True)
    run, steps = Run(entry, tmp_path, budget, **options), 3
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        if entry == "prepare":
            micro, acc, ooms, peaks = _loop_micro_batch(model, sample, budget, options, steps)
        else:
            trainer = run.trainer(
                model,
                Rows(sample, repeat=steps),
                per_device_train_batch_size=GLOBAL,
                max_steps=steps,
                optim="adamw_torch",
                logging_steps=1,
            )
            with metered(model) as dev:
                meter = StepMeter(dev)
                later = _Inflate(dev, trainer)
                trainer.add_callback(meter)
                trainer.add_callback(later)
                trainer.train()
            a = trainer.args
            micro, acc, ooms, peaks = (
                a.per_device_train_batch_size,
                a.gradient_accumulation_steps,
                dev.ooms,
                meter.peaks,
            )
            assert trainer.state.global_step == steps
            logged = [h for h in trainer.state.log_history if "adacc/micro_batch" in h]
            assert logged and logged[0]["adacc/micro_batch"] == micro, "the choice as a metric"
            assert any("adacc/event_oom" in h for h in trainer.state.log_history)
    print(f"{entry}: micro-batch {micro} x {acc}, {ooms} out of memory, step peaks {peaks}")
    assert micro < GLOBAL and micro * acc == GLOBAL
    assert ooms >= 1 and "re-planned" in caplog.text
    assert len(peaks) == steps and max(peaks[1:]) <= budget  # after the error, within the device


def _loop_micro_batch(
    model: torch.nn.Module, sample: dict, budget: int, options: dict, steps: int
) -> tuple[int, int, int, list[int]]:
    """`prepare(auto_batch_size=True)` and a loop of ``session.run_step`` over its micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeviceMeter(baseline=live_state_nbytes(model, opt, list(sample.values()))) as dev:
        session = prepare(model, budget, sample, optimizer=opt, global_batch=GLOBAL, **options)
        m, acc = session.micro_batch, session.accumulation
        parts = [{k: v[i * m : (i + 1) * m] for k, v in sample.items()} for i in range(acc)]
        peaks = []
        for step in range(1, steps + 1):
            dev.reset_peak()
            session.run_step(lambda b: (model(**b).loss / acc).backward(), parts)
            opt.step()
            opt.zero_grad(set_to_none=True)
            session.step_done(step)
            peaks.append(dev.peak_nbytes)
            if step == 1:
                inflate(dev, session)
        ooms = dev.ooms
    session.close()
    return m, acc, ooms, peaks


# ------------------------------------------------------------------ 2 and 3. longer batch, resume
def _train(
    entry: str, tmp_path: Any, budget: int, profile_from: str | None = None
) -> tuple[AdaccSession, list[int], int, Callable]:
    """The short batch, then the 4x longer one, through `entry`; returns the session, the step
    peaks, the first MLP's forwards and a function measuring a policy on the long batch."""
    model, short, long = tiny()
    calls = BlockCalls(model)
    options = dict(QUICK, **({"profile_from": profile_from} if profile_from else {}))
    if entry == "prepare":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        peaks, session = [], None
        with metered(model) as meter:
            for step, batch in enumerate([short, long], 1):
                batch = {k: v.clone() for k, v in batch.items()}
                if session is None:
                    session = prepare(model, budget, batch, optimizer="adamw_torch", **options)
                session.run_step(lambda b: model(**b).loss.backward(), batch)
                opt.step()
                opt.zero_grad(set_to_none=True)
                session.step_done(step)
                peaks.append(meter.reset_peak())
                del batch
        session.close()
    else:
        trainer = Run(entry, tmp_path, budget, **options).trainer(
            model, Sequence(short, long), optim="adamw_torch"
        )
        with metered(model) as meter:
            steps = StepMeter(meter)
            trainer.add_callback(steps)
            trainer.train()
        session, peaks, opt = session_of(trainer), steps.peaks, trainer.optimizer
    calls.handle.remove()
    return session, peaks, calls.n, lambda p: step_peak(model, p, long, opt)


@pytest.mark.parametrize(
    "entry",
    [pytest.param(e, marks=[pytest.mark.slow] if e in SLOW_RESUME else []) for e in ENTRY_POINTS],
)
def test_a_longer_batch_and_saved_profiles(entry, tmp_path, caplog):
    model, _, long = tiny()
    budget = long_budget(model, long, "adamw_torch")
    del model
    session, peaks, _, on_long = _train(entry, tmp_path, budget)
    check_plans(session, peaks, budget, on_long)
    saved = str(tmp_path)
    if entry == "prepare":
        from adacc_hf.integrations import write_artifacts

        write_artifacts(saved, session)
    first = {k: p.policy.fingerprint() for k, p in session.plans.items()}
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        again, peaks2, calls, _ = _train(entry, tmp_path, budget, profile_from=saved)
    assert caplog.text.count("planned from") == 2, caplog.text
    assert calls <= REUSED, f"{calls} forwards of the first MLP: it was profiled again"
    assert {k: p.policy.fingerprint() for k, p in again.plans.items()} == first
    assert max(peaks2) <= budget
    assert {SHORT, LONG} <= set(again.plans)


def test_a_callback_added_after_the_trainer_was_made_cannot_pick_the_micro_batch(tmp_path):
    """The Trainer built its data loader's batch size before a late callback could plan it: a
    clear error before any profiling."""
    from adacc_hf import AdaccError

    model = assets.tiny_model("llama", seed=0, num_hidden_layers=2)
    sample = assets.tiny_batch("llama", model, batch_size=GLOBAL, seq_len=16)
    args = TrainingArguments(**{**TRAINER, "output_dir": str(tmp_path), "max_steps": 1})
    late = Trainer(model=model, args=args, train_dataset=Rows(sample, repeat=1))
    late.add_callback(AdaccCallback(budget=10**9, auto_batch_size=True))
    with pytest.raises(AdaccError, match="when the Trainer is made"):
        late.train()
