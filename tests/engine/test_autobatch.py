"""Automatic micro-batch: the chosen micro-batch's measured step peak (a real step with its
accumulation and the optimizer) fits the budget, and the next larger candidate either does not fit
(measured under full checkpointing, the least any policy holds) or has lower predicted tokens/s;
and `AdaccTrainer` trains with the choice end to end."""

from __future__ import annotations

import logging

import pytest
import torch
from batch_rows import Rows

from adacc_hf import apply_adacc, assets, measure_step_peak, prepare
from adacc_hf.engine.autobatch import choose_micro_batch, rows
from adacc_hf.engine.config import AdaccConfig

GLOBAL = 8


def _peak(model, sample, mb, acc, opt, hf=False) -> int:
    """Measured step peak of micro-batch `mb` with its `acc` micro-batches, distinct tensors all
    alive as the Trainer's ``get_batch_samples`` holds them."""
    batches = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in rows(sample, mb).items()}
        for _ in range(acc)
    ]
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    if hf:
        (enable or model.gradient_checkpointing_enable)()
    try:
        measure_step_peak(model, batches, opt)  # optimizer states exist
        return measure_step_peak(model, batches, opt).peak_nbytes
    finally:
        if hf:
            (disable or model.gradient_checkpointing_disable)()


def _check(model, sample, choice, budget, opt, measured):
    assert measured <= budget, (choice.message(), measured, budget)
    i = next(i for i, c in enumerate(choice.candidates) if c.micro_batch == choice.micro_batch)
    if i + 1 < len(choice.candidates):
        nxt = choice.candidates[i + 1]
        if nxt.tokens_per_s is not None:  # fits: predicted slower
            assert nxt.tokens_per_s <= choice.tokens_per_s, choice.message()
        else:  # does not fit, measured with the least any policy holds
            least = _peak(model, sample, nxt.micro_batch, nxt.accumulation, opt, hf=True)
            assert least > budget, (choice.message(), least, budget)


@pytest.mark.parametrize(
    "family",
    ["gpt2", pytest.param("llama", marks=pytest.mark.slow)],  # llama: make test-all
)
def test_auto_micro_batch_fits_and_the_next_larger_does_not_or_is_slower(family, caplog):
    model = assets.tiny_model(family)
    sample = assets.tiny_batch(family, model, batch_size=GLOBAL, seq_len=48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tight = _peak(model, sample, 2, GLOBAL // 2, opt, hf=True) * 102 // 100
    loose = _peak(model, sample, 4, GLOBAL // 4, opt, hf=True) * 105 // 100
    # Through `prepare`: the session starts on the chosen plan and reports it.
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        session = prepare(
            model,
            tight,
            sample,
            adaptive=False,
            auto_batch_size=True,
            global_batch=GLOBAL,
            profile_repeats=1,
        )
    choice = session.batch_choice
    assert (session.micro_batch * session.accumulation, choice.micro_batch) == (
        GLOBAL,
        session.micro_batch,
    )
    assert any(e.kind == "batch" for e in session.events)
    assert "auto micro-batch" in caplog.text
    try:
        measured = _peak(model, sample, choice.micro_batch, choice.accumulation, opt)
    finally:
        session.close()
    _check(model, sample, choice, tight, opt, measured)
    # Another budget, the same profiles.
    config = AdaccConfig(budget=loose, adaptive=False, profile_repeats=1)
    other = choose_micro_batch(model, sample, config, GLOBAL, profiles=choice.profiles)
    assert other.micro_batch >= choice.micro_batch
    with apply_adacc(model, other.policy):
        measured = _peak(model, sample, other.micro_batch, other.accumulation, opt)
    _check(model, sample, other, loose, opt, measured)


@pytest.mark.slow  # tests/integrations/test_entry_point_parity.py runs the micro-batch in every entry point
def test_adacc_trainer_picks_the_micro_batch_and_keeps_the_global_batch(tmp_path):
    from transformers import Trainer, TrainingArguments

    from adacc_hf import AdaccCallback, AdaccError, AdaccTrainer, AdaccTrainingArguments

    model = assets.tiny_model("gpt2")
    sample = assets.tiny_batch("gpt2", model, batch_size=GLOBAL, seq_len=48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = _peak(model, sample, 2, GLOBAL // 2, opt, hf=True) * 102 // 100
    del opt

    def args(**kw):
        return AdaccTrainingArguments(
            output_dir=str(tmp_path / "out"),
            adacc=True,
            adacc_budget=str(budget),
            adacc_auto_batch_size=True,
            adacc_adaptive=False,
            per_device_train_batch_size=GLOBAL,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            optim="adamw_torch",
            **kw,
        )

    trainer = AdaccTrainer(model=model, args=args(), train_dataset=Rows(sample, repeat=1))
    trainer.train()
    a = trainer.args
    assert a.per_device_train_batch_size < GLOBAL
    assert a.per_device_train_batch_size * a.gradient_accumulation_steps == GLOBAL
    logged = [h for h in trainer.state.log_history if "adacc/micro_batch" in h]
    assert logged and logged[0]["adacc/micro_batch"] == a.per_device_train_batch_size
    # A callback added after the Trainer was made comes after its data loader: a clear error,
    # before any profiling.
    late = Trainer(
        model=assets.tiny_model("gpt2"),
        args=TrainingArguments(
            output_dir=str(tmp_path / "late"),
            per_device_train_batch_size=GLOBAL,
            max_steps=1,
            report_to="none",
            use_cpu=True,
        ),
        train_dataset=Rows(sample, repeat=1),
    )
    late.add_callback(AdaccCallback(budget=budget, auto_batch_size=True))
    with pytest.raises(AdaccError, match="when the Trainer is made"):
        late.train()
