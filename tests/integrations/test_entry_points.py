"""Every entry point plans each new bucket before its forward: a run of a short batch (2 x 16) and
then one 4x longer (2 x 64), every optimizer step's peak measured by an independent meter
(`step_meter`: the live storages of the whole step, profiling included) within the budget.

The budget lies between full recomputation's and no checkpointing's step peaks at the long batch,
where the short batch's plan run on the long batch (measured too) does not fit: an entry point
that kept the short plan would fail. Tiny LLaMA, 4 blocks, CPU; the run's own optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from batch_rows import Rows
from step_meter import StepMeter, metered
from transformers import Trainer, TrainingArguments

from adacc_hf import (
    AdaccCallback,
    AdaccSession,
    AdaccTrainer,
    AdaccTrainingArguments,
    Policy,
    apply_adacc,
    assets,
    estimate_static_memory,
    measure_step_peak,
    prepare,
    profile_model,
)
from adacc_hf.solver import budget_between

Batch = dict[str, torch.Tensor]
SHORT, LONG = (2, 16, 0), (2, 64, 0)  # the two buckets (micro-batch, length, padded)
#: Between full recomputation (0) and no checkpointing (1) at the long batch. Profiling a bucket
#: mid-run once held one or two blocks without checkpointing on top of full recomputation, and at
#: 0.3 the long bucket's profiling step went 3.4 % over; profiling now runs inside the room the
#: budget leaves (`profiler.room`), so the tight end is what these tests check.
FRACTION = 0.3
#: Sessions of the default test run: exact actions only (retain, recompute, no checkpointing), so
#: no codec is profiled; the buckets' planning is what these tests are about.
QUICK: dict[str, Any] = {"codecs": [], "profile_repeats": 1}


def tiny() -> tuple[torch.nn.Module, Batch, Batch]:
    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    short = assets.tiny_batch("llama", model, batch_size=2, seq_len=16)
    long = assets.tiny_batch("llama", model, batch_size=2, seq_len=64, seed=1)
    return model, short, long


def long_budget(
    model: torch.nn.Module,
    long: Batch,
    optimizer: str,
    autocast: torch.dtype | None = None,
    mixed_precision: str | None = None,
) -> int:
    static = estimate_static_memory(model, optimizer=optimizer, mixed_precision=mixed_precision)
    # memory alone sets the range: no codec is profiled
    profile = profile_model(model, long, repeats=1, autocast=autocast, codecs=[])
    return budget_between(profile, static, FRACTION)


def check_plans(
    session: AdaccSession,
    peaks: list[int],
    budget: int,
    over: Callable[[Policy], int],
) -> None:
    """Both buckets planned, every step within the budget, the short plan over it on the long
    batch (`over`: that plan's measured step peak there)."""
    assert {SHORT, LONG} <= set(session.plans), list(session.plans)
    stale = over(session.plans[SHORT].policy)
    print(f"budget {budget}, step peaks {peaks}, the short plan on the long batch {stale}")
    assert len(peaks) == 2 and max(peaks) <= budget, (peaks, budget)
    assert stale > budget, (stale, budget)


def step_peak(
    model: torch.nn.Module,
    policy: Policy,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    autocast: torch.dtype | None = None,
) -> int:
    """One training step of `batch` under `policy` with `optimizer`, measured."""
    model.train()
    with apply_adacc(model, policy):
        return measure_step_peak(model, batch, optimizer, autocast=autocast).peak_nbytes


# ------------------------------------------------------------------ Trainer entry points
class Sequence(torch.utils.data.Dataset):
    """The short batch's rows, then the long batch's: with sequential sampling and two rows per
    device, step 1 trains the short batch and step 2 the long one."""

    def __init__(self, *batches: Batch) -> None:
        self.rows = [r for b in batches for r in Rows(b, repeat=1).rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Batch:
        return self.rows[i]


TRAINER = dict(
    max_steps=2,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
    train_sampling_strategy="sequential",
    optim="adamw_torch_fused",
)


def train_metered(trainer: Trainer, model: torch.nn.Module) -> list[int]:
    """Train, every optimizer step's peak metered (the first step's profiling included)."""
    with metered(model) as meter:
        steps = StepMeter(meter)
        trainer.add_callback(steps)
        trainer.train()
    return steps.peaks


def adacc_session(trainer: Trainer) -> AdaccSession:
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AdaccCallback))
    assert cb.session is not None
    return cb.session


@pytest.mark.slow  # 40-60 s each; tests/integrations/test_entry_point_parity.py runs every entry point
@pytest.mark.parametrize("trainer_class", [Trainer, AdaccTrainer])
def test_training_arguments_plan_the_longer_batch_within_budget(tmp_path, trainer_class):
    """`AdaccTrainingArguments(adacc=True)` in a plain `Trainer` and in `AdaccTrainer`."""
    model, short, long = tiny()
    budget = long_budget(model, long, "adamw_torch_fused")
    args = AdaccTrainingArguments(
        output_dir=str(tmp_path), adacc=True, adacc_budget=str(budget), **TRAINER
    )
    trainer = trainer_class(model=model, args=args, train_dataset=Sequence(short, long))
    peaks = train_metered(trainer, model)
    check_plans(
        adacc_session(trainer),
        peaks,
        budget,
        lambda p: step_peak(model, p, long, trainer.optimizer),
    )


@pytest.mark.slow  # tests/integrations/test_entry_point_parity.py runs it (and every other entry point)
def test_callback_in_a_plain_trainer_plans_the_longer_batch_within_budget(tmp_path):
    model, short, long = tiny()
    budget = long_budget(model, long, "adamw_torch_fused")
    args = TrainingArguments(output_dir=str(tmp_path), **TRAINER)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Sequence(short, long),
        callbacks=[AdaccCallback(budget=budget, **QUICK)],
    )
    peaks = train_metered(trainer, model)
    check_plans(
        adacc_session(trainer),
        peaks,
        budget,
        lambda p: step_peak(model, p, long, trainer.optimizer),
    )


# ------------------------------------------------------------------ custom loops, Accelerate
def loop_metered(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    start: Callable[[Batch], AdaccSession],
    batches: list[Batch],
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward(),
) -> tuple[AdaccSession, list[int]]:
    """A custom loop over `batches`, `start(first batch)` (``prepare``) inside the first step;
    every step's peak metered (its batch made inside the meter, as a data loader makes it)."""
    peaks: list[int] = []
    with metered(model) as meter:
        for step, batch in enumerate(batches, 1):
            batch = {k: v.clone() for k, v in batch.items()}
            if step == 1:
                session = start(batch)
            backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step_done(step)
            peaks.append(meter.reset_peak())
            del batch
    session.close()
    return session, peaks


@pytest.mark.parametrize(
    "sample",
    # 30-50 s each on the shared CPU; tests/integrations/test_entry_point_parity.py runs the sample_batch one
    [pytest.param(True, marks=pytest.mark.slow), pytest.param(False, marks=pytest.mark.slow)],
    ids=["sample_batch", "first_forward"],
)
def test_prepare_plans_the_longer_batch_within_budget(sample):
    """`prepare(model, budget, sample_batch=short)` (plans now) and `prepare(model, budget)`
    (plans on the first training forward): either way the long batch gets its own plan."""
    model, short, long = tiny()
    budget = long_budget(model, long, "adamw_torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def start(batch: Batch) -> AdaccSession:
        return prepare(model, budget, batch if sample else None, optimizer="adamw_torch", **QUICK)

    session, peaks = loop_metered(model, opt, start, [short, long])
    check_plans(session, peaks, budget, lambda p: step_peak(model, p, long, opt))


@contextlib.contextmanager
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide state as the Trainer tests expect it, before and after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow  # 60 s on the shared CPU: bf16, every codec profiled
def test_accelerate_with_mixed_precision_plans_the_longer_batch_within_budget():
    """README's Accelerate loop, bf16 mixed precision (Accelerate's autocast around the forward):
    ``accelerator.prepare(model, optimizer)``, then `prepare` with the first batch."""
    from accelerate import Accelerator

    model, short, long = tiny()
    bf16 = torch.bfloat16
    budget = long_budget(model, long, "adamw_torch", autocast=bf16, mixed_precision="bf16")
    with fresh_accelerate():
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        wrapped, opt = accelerator.prepare(model, opt)

        def start(batch: Batch) -> AdaccSession:
            # README's call: the autocast is read off Accelerate's wrapped forward
            return prepare(wrapped, budget, batch, optimizer="adamw_torch")

        session, peaks = loop_metered(wrapped, opt, start, [short, long], accelerator.backward)
        assert session.autocast == bf16
        check_plans(session, peaks, budget, lambda p: step_peak(model, p, long, opt, bf16))


def test_prepare_before_accelerate_plans_under_its_mixed_precision(caplog):
    """README's order: `prepare` with a sample batch, then ``accelerator.prepare``. The session
    plans under the ``Accelerator``'s bf16 (its profile traced under bf16) and the loop's steps
    run with no adacc warning (a plan traced in fp32 has its kept ops recomputed, one warning per
    region)."""
    from accelerate import Accelerator

    model, short, _ = tiny()
    bf16 = torch.bfloat16
    budget = long_budget(model, short, "adamw_torch", autocast=bf16, mixed_precision="bf16")
    with fresh_accelerate(), caplog.at_level(logging.INFO, logger="adacc_hf"):
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        session = prepare(model, budget, short, optimizer=opt, **QUICK)
        assert session.autocast == bf16
        assert session.current.profile.autocast == str(bf16)
        assert session.config.run.optimizer == "adamw_torch"  # read off the object
        wrapped, opt = accelerator.prepare(model, opt)
        for _ in range(2):
            accelerator.backward(wrapped(**short).loss)
            opt.step()
            opt.zero_grad()
        session.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "planning again" not in caplog.text


def test_a_forward_under_another_autocast_is_planned_under_it(caplog):
    """Planned on a sample batch with no autocast, trained under the loop's own bf16 region: the
    first such forward plans again under bf16 (no adacc warning; a plan traced in fp32 would
    recompute its kept ops), and the fp32 plans come back for fp32 forwards."""
    model, short, _ = tiny()
    bf16 = torch.bfloat16
    budget = long_budget(model, short, "adamw_torch", autocast=bf16, mixed_precision="bf16")
    session = prepare(model, budget, short, **QUICK)
    assert session.autocast is None
    fp32_plan = session.current
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        for _ in range(2):
            with torch.autocast("cpu", dtype=bf16):
                loss = model(**short).loss
            loss.backward()
        assert session.autocast == bf16 and session.current.profile.autocast == str(bf16)
        model(**short).loss.backward()
    assert session.current is fp32_plan
    assert caplog.text.count("planning again") == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    session.close()


def test_a_training_forward_asks_its_layers_for_no_cache():
    """The config's ``use_cache=True`` (LLaMA's default) would have every checkpointed layer drop
    the cache with transformers' "Caching is incompatible with gradient checkpointing" warning,
    in a loop that enabled no checkpointing: the session's training forwards ask for none (a
    forward that asks for a cache itself keeps it)."""
    model, short, _ = tiny()
    model.config.use_cache = True
    seen: list = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("use_cache")), with_kwargs=True
    )
    model(**short)  # before adacc: the layers get the config's default
    assert seen == [True]
    session = prepare(model, 10 * 2**30, short, **QUICK)
    seen.clear()
    model(**short).loss.backward()
    model(**short, use_cache=True).loss.backward()
    session.close()
    assert seen == [False, True] and model.config.use_cache


def test_adacc_options_without_adacc_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        AdaccTrainingArguments(output_dir="out", use_cpu=True, report_to="none")
        assert not caplog.records
        AdaccTrainingArguments(
            output_dir="out", use_cpu=True, report_to="none", adacc_budget="20GiB"
        )
    assert "adacc_budget" in caplog.text and "adacc=True" in caplog.text


# ------------------------------------------------------------------ TRL
@pytest.mark.slow  # 60 s on the shared CPU: two buckets profiled under TRL's [tokens, 32768] head
def test_trl_sft_trainer_plans_the_longer_batch_within_budget(tmp_path):
    """TRL's `SFTTrainer` with the callback: its `max_length` (the long batch) is planned before
    the first step, the short bucket when it comes; TRL's own LM head and bf16 autocast."""

    import test_trl as t

    model = assets.tiny_model("llama", seed=0, **t.MODEL)
    rows = t.texts(4)  # 4 rows: lengths 63, 30, 60, 25 words: reorder to 15, 15, 63, 63
    rows = rows.from_dict(
        {
            "text": [" ".join(r.split()[:15]) for r in rows["text"][1::2]]
            + [" ".join((r.split() * 2)[:63]) for r in rows["text"][::2]]
        }
    )
    args = t.sft_config(tmp_path, max_steps=2, train_sampling_strategy="sequential")
    callback = AdaccCallback(
        budget="1GiB", profile_repeats=1
    )  # budget replaced below, before training
    trainer = t.trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        processing_class=t.tokenizer(),
        callbacks=[callback],
    )
    batches = list(trainer.get_train_dataloader())
    assert [tuple(b["input_ids"].shape) for b in batches] == [SHORT[:2], LONG[:2]]
    long = {**batches[1], **t.TRL_KWARGS}
    bf16 = t.amp(args)
    budget = long_budget(model, long, str(args.optim.value), bf16, "bf16")
    callback.config = callback.config.replace(budget=budget)
    peaks = train_metered(trainer, model)
    session = adacc_session(trainer)
    assert session.config.memory.max_seq_len == 64
    check_plans(
        session, peaks, budget, lambda p: step_peak(model, p, long, trainer.optimizer, bf16)
    )


def test_a_bad_verbosity_says_what_is_accepted():
    """``ADACC_VERBOSITY`` with an unknown level logs at info and says which levels exist."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ADACC_VERBOSITY": "loud"}
    out = subprocess.run(
        [sys.executable, "-c", "import adacc_hf"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0
    assert "ADACC_VERBOSITY='loud' is not one of debug, info, warning, error" in out.stderr
