"""Out of memory is recovered, not a crash: a simulated device (`runtime.capacity.DeviceMeter`)
raises what a GPU raises past its capacity, and the run trains to the end with a logged re-plan."""

from __future__ import annotations

import logging

import pytest
import torch
from batch_rows import Rows
from step_meter import StepMeter, metered
from test_trainer import _args, mixed_budget
from transformers import Trainer, TrainerCallback

from adacc_hf import AdaccCallback, AdaccTrainer, assets
from adacc_hf.engine.oom import grown_reserve, parse_oom
from adacc_hf.runtime.capacity import DeviceMeter, oom_count

MiB = 2**20


def _gpt2(seed=0):
    return assets.tiny_model("gpt2", seed=seed, n_layer=4)  # dropout 0.1: random states matter


def _batch(model):
    return assets.tiny_batch("gpt2", model, batch_size=4, seq_len=48)


class _CapacityFrom(TrainerCallback):
    """The simulated device gets its capacity after the first step (profiling is the subject of
    tests/engine/test_first_step.py; here it is the plan that under-predicts)."""

    def __init__(self, capacity):
        self.capacity, self.meter = capacity, None

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.capacity = self.capacity


def _run(tmp_path, budget, capacity=None, inflate=1.0, trainer_cls=AdaccTrainer, **kw):
    model = _gpt2()
    batch = _batch(model)
    args = _args(
        tmp_path,
        budget,
        adacc=False,
        max_steps=3,
        save_strategy="no",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=len(batch["input_ids"]),
        **kw,
    )
    cb = AdaccCallback(budget=budget, codecs=[], profile_repeats=1, adaptive=False)  # exact
    trainer = trainer_cls(model=model, args=args, train_dataset=Rows(batch), callbacks=[cb])
    meter, later = StepMeter(None), _CapacityFrom(capacity)
    trainer.add_callback(meter)
    trainer.add_callback(later)
    with metered(model, None, inflate) as dev:
        meter.meter = later.meter = dev
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, model, losses, dev, meter


def test_the_meter_raises_what_a_device_raises_and_counts_it():
    before = oom_count(torch.device("cpu"))
    x = torch.ones(1024)  # made before: not counted
    with DeviceMeter(capacity=16 * 1024) as dev:
        y = x * 2  # 4 KiB
        with pytest.raises(torch.OutOfMemoryError) as err:
            torch.empty(4 * 1024, dtype=torch.float32).add_(1)  # 16 KiB more
        assert dev.live_nbytes == 4096  # the failed op's output is gone
        del y
        assert dev.live_nbytes == 0 and dev.peak_nbytes == 4096
    assert oom_count(torch.device("cpu")) == before + 1 and dev.ooms == 1
    sizes = parse_oom(str(err.value))
    assert sizes == {"tried": 16384, "free": 16384 - 4096, "in_use": 4096}


def test_reserve_grows_past_the_missing_bytes_and_doubles():
    budget, static = 1000 * MiB, 200 * MiB
    cuda = (
        "CUDA out of memory. Tried to allocate 120.00 MiB. GPU 0 has a total capacity of 1.00 GiB"
        " of which 20.00 MiB is free. Including non-PyTorch memory, this process has 900.00 MiB "
        "memory in use."
    )
    first = grown_reserve(0, budget, static, cuda)
    assert first >= budget - 920 * MiB + 80 * MiB  # plans under what the device holds
    assert grown_reserve(first, budget, static, "out of memory") >= 2 * first
    assert grown_reserve(0, budget, static, "") >= (budget - static) // 10


@pytest.mark.parametrize(
    "trainer_cls",
    [AdaccTrainer, pytest.param(Trainer, marks=pytest.mark.slow)],  # the same retry: 40 s
    ids=["AdaccTrainer", "Trainer"],
)
def test_a_plan_that_under_predicts_is_replanned_and_the_step_rerun_exactly(
    tmp_path, caplog, trainer_cls
):
    """Every allocation 10 % larger than planned, on a device exactly the budget's size: the
    step that runs out is re-planned and re-run (both micro-batches of its accumulation window),
    the run ends, and its losses are bit-identical to a run on an unbounded device; under
    AdaccTrainer and under a plain Trainer with the callback alike."""
    model = _gpt2()
    budget = mixed_budget(model, _batch(model), fraction=0.6)
    _, ref_model, ref_losses, _, ref = _run(tmp_path / "ref", budget, trainer_cls=trainer_cls)
    capacity = max(ref.peaks[1:])  # the device holds exactly what the plan really takes
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        trainer, model, losses, dev, meter = _run(
            tmp_path / "oom", budget, capacity, 1.1, trainer_cls=trainer_cls
        )
    assert dev.ooms >= 1
    assert trainer.state.global_step == 3
    if trainer_cls is AdaccTrainer:
        assert any("adacc/event_oom" in e for e in trainer.state.log_history)
    assert "out of memory" in caplog.text and "re-planned" in caplog.text
    assert "recomputed" not in caplog.text  # a forward cut short builds no slot table
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert max(meter.peaks[1:]) <= capacity  # steps after the re-plan fit the device


@pytest.mark.slow
def test_the_plain_trainer_with_auto_find_batch_size_keeps_its_batch_after_an_error(
    tmp_path, caplog
):
    """With ``auto_find_batch_size`` accelerate would halve the batch after an error; the step is
    re-planned and run again first (the callback wires the retry into any Trainer), so the batch
    is kept."""
    model = _gpt2()
    budget = mixed_budget(model, _batch(model), fraction=0.6)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        trainer, _, losses, dev, _ = _run(
            tmp_path,
            budget,
            int(0.9 * budget),
            1.1,
            trainer_cls=Trainer,
            auto_find_batch_size=True,
        )
    assert dev.ooms >= 1
    assert trainer.state.global_step == 3 and len(losses) == 3
    assert trainer._train_batch_size == 4, "the retry kept the batch: accelerate never halved it"
    assert "re-planned" in caplog.text
    assert "recomputed" not in caplog.text  # a forward cut short builds no slot table


@pytest.mark.slow
def test_auto_micro_batch_on_a_device_smaller_than_the_budget_trains_to_the_end(tmp_path, caplog):
    """The budget says 8 rows fit without checkpointing; the device holds what 2 rows take:
    the search ends at the first micro-batch whose planning runs out, and the chosen one trains
    to the end, re-planned after any error, without raising."""
    from adacc_hf import AdaccTrainingArguments, measure_step_peak

    model = _gpt2()
    sample = assets.tiny_batch("gpt2", model, batch_size=8, seq_len=48)
    opt = torch.optim.AdamW(model.parameters())
    budget = measure_step_peak(model, sample, opt).peak_nbytes  # 8 rows, no checkpointing
    # (3 rows' no longer stops the search: 8 rows' profiling fits it since a plain block is
    # measured alone, and the search picks 8 rows, re-planned after the step's error)
    capacity = measure_step_peak(model, {k: v[:2] for k, v in sample.items()}, opt).peak_nbytes
    del opt
    model.zero_grad(set_to_none=True)
    args = AdaccTrainingArguments(
        output_dir=str(tmp_path / "out"),
        adacc=True,
        adacc_budget=str(budget),
        adacc_auto_batch_size=True,
        adacc_adaptive=False,
        adacc_codecs=["int4_outlier"],
        per_device_train_batch_size=8,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        optim="adamw_torch",
    )
    trainer = AdaccTrainer(model=model, args=args, train_dataset=Rows(sample, repeat=2))
    with caplog.at_level(logging.INFO, logger="adacc_hf"), metered(model, capacity) as dev:
        trainer.train()
    assert dev.ooms >= 1
    assert "out of memory while planning" in caplog.text  # the search stopped there
    assert trainer.state.global_step == 3
    a = trainer.args
    assert a.per_device_train_batch_size < 8
    assert a.per_device_train_batch_size * a.gradient_accumulation_steps == 8


@pytest.mark.slow
def test_a_custom_loop_that_catches_the_error_is_replanned_at_its_next_forward(caplog):
    from adacc_hf import estimate_static_memory, prepare, profile_model
    from adacc_hf.runtime.peak import live_state_nbytes
    from adacc_hf.solver import budget_between

    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    # Activations large beside the static bytes, and a budget where nothing is checkpointed
    # (no timing-dependent plan): a plan with recomputation fits the device 10 % over. (At 32
    # tokens and 0.8 of the range even full recomputation 10 % over did not fit the capacity.)
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=128)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    static = estimate_static_memory(model, optimizer="adamw_torch")
    budget = budget_between(profile_model(model, batch, repeats=1), static, 1.0)
    session = prepare(
        model, budget, batch, codecs=[], adaptive=False, optimizer="adamw_torch", profile_repeats=1
    )
    planned = session.policy.metadata["predicted"]["peak_nbytes"]

    def step() -> bool:
        try:
            model(**batch).loss.backward()
            opt.step()
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad(set_to_none=True)
        return True

    with DeviceMeter(baseline=live_state_nbytes(model, opt, list(batch.values()))) as dev:
        assert step()
        dev.capacity, dev.inflate = dev.peak_nbytes, 1.1  # now every allocation runs 10 % over
        dev.reset_peak()
        assert not step()  # the loop catches it and goes on
        with caplog.at_level(logging.WARNING, logger="adacc_hf"):
            dev.reset_peak()
            assert step()
    assert "re-planned" in caplog.text
    assert session.oom_reserve_nbytes > 0
    assert session.policy.metadata["predicted"]["peak_nbytes"] < planned
    assert dev.peak_nbytes <= dev.capacity
    session.close()


def test_a_custom_loop_runs_its_step_again_after_an_error(caplog):
    """`prepare` + ``session.run_step``: from the second step every allocation 10 % larger on a
    device that holds what the run's own plan took (whatever plan the machine's timings chose);
    the micro-batch that runs out is re-planned and the optimizer step's two micro-batches run
    again with their own random states (dropout on): the weights after three steps are
    bit-identical to a run on an unbounded device."""
    from adacc_hf import prepare
    from adacc_hf.runtime.peak import live_state_nbytes

    def train(short=False):
        model = _gpt2()
        batch = _batch(model)
        budget = mixed_budget(model, batch, fraction=0.6)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        session = prepare(
            model, budget, batch, codecs=[], adaptive=False, optimizer=opt, profile_repeats=1
        )
        torch.manual_seed(1)
        halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
        losses = []

        def micro(b):
            loss = model(**b).loss / 2
            loss.backward()
            return loss.item()

        base = live_state_nbytes(model, opt, list(batch.values()))
        with DeviceMeter(baseline=base) as dev:
            for step in range(3):
                if step == 1 and short:  # the device holds what this run's own plan took
                    dev.capacity, dev.inflate = dev.peak_nbytes, 1.1
                    dev.reset_peak()
                losses.append(session.run_step(micro, halves))
                opt.step()
                opt.zero_grad(set_to_none=True)
                session.step_done(step + 1)
            peak = dev.peak_nbytes
        session.close()
        return model, losses, dev, peak

    ref_model, ref_losses, _, _ = train()
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        model, losses, dev, peak = train(short=True)
    assert dev.ooms >= 1 and "running the step's" in caplog.text
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert peak <= dev.capacity  # the steps after the re-plan fit the device
