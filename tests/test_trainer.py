"""A plain HF Trainer with AdaccTrainingArguments trains under a budget, saves and resumes the
policy, and writes it into the model card and config.json."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import HfArgumentParser, Trainer

from adacc_hf import (
    AdaccError,
    AdaccTrainer,
    AdaccTrainingArguments,
    Policy,
    activation_memory_report,
    apply_adacc,
    assets,
    estimate_static_memory,
    profile_model,
)
from adacc_hf.integrations.trainer import POLICY_FILE, AdaccCallback


class Rows(torch.utils.data.Dataset):
    """The rows of one tiny batch, repeated: loss falls fast on it."""

    def __init__(self, batch, repeat=8):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
        self.repeat = repeat

    def __len__(self):
        return len(self.rows) * self.repeat

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]


def mixed_budget(model, batch, fraction=0.4) -> int:
    """A budget between full recomputation's need and no-checkpointing's."""
    static = estimate_static_memory(model, optimizer="adamw_torch").total
    prof = profile_model(model, batch, repeats=1)
    low = (
        static
        + prof.full_recompute_nbytes()
        + max(max(g.transient_nbytes for g in prof.groups.values()), prof.nonblock_transient_nbytes)
    )
    high = static + prof.no_checkpoint_nbytes()
    return int(low + fraction * (high - low))


def _args(tmp_path, budget, **kw):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        adacc=True,
        adacc_memory_budget=str(budget),
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    defaults.update(kw)
    return AdaccTrainingArguments(**defaults)


def _session(trainer):
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AdaccCallback))
    return cb.session


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_plain_trainer_trains_under_a_budget_with_a_mixed_policy(tmp_path, family):
    model = assets.tiny_model(family, seed=0)
    batch = assets.tiny_batch(family, model)
    budget = mixed_budget(model, batch)
    args = _args(tmp_path, budget)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(batch))
    trainer.train()
    session = _session(trainer)
    policy = session.policy
    assert policy is not None and policy.metadata["source"] == "milp"
    kinds = {
        str(a).split(":")[0]
        for g in policy.groups.values()
        for v in g.variants
        for a in v.actions.values()
    } | {"no_checkpoint" for g in policy.groups.values() for v in g.variants if not v.checkpoint}
    assert len(kinds) >= 2, f"not a mixed policy: {kinds}"
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    # Measured activation memory fits the budget's activation share.
    pred = policy.metadata["predicted"]
    share = budget - policy.metadata["static_nbytes"] - pred["transient_nbytes"]
    model.train()
    with apply_adacc(model, policy):
        held = activation_memory_report(model, batch).total
    assert held <= share, (held, share)
    assert abs(held - pred["held_nbytes"]) <= 0.05 * pred["held_nbytes"]
    # The checkpoint and the output dir hold the policy; the model is unpatched after training.
    for d in (tmp_path / "out" / "checkpoint-3", tmp_path / "out"):
        assert Policy.load(str(d / POLICY_FILE)) == policy
    assert not any("_gradient_checkpointing_func" in vars(m) for m in model.modules())


def test_adacc_trainer_resumes_policy_and_writes_model_card(tmp_path):
    from huggingface_hub import ModelCard

    model = assets.tiny_model("llama", seed=0)
    batch = assets.tiny_batch("llama", model)
    budget = mixed_budget(model, batch)
    trainer = AdaccTrainer(model=model, args=_args(tmp_path, budget), train_dataset=Rows(batch))
    trainer.train()
    policy = trainer.adacc_session.policy
    logged = [e for e in trainer.state.log_history if "adacc/event_policy" in e]
    assert logged and logged[0]["adacc/predicted_peak_mib"] > 0

    trainer.save_model()
    trainer.create_model_card(model_name="tiny-adacc")
    out = tmp_path / "out"
    card = ModelCard.load(str(out / "README.md"))
    assert card.data.adacc["policy_fingerprint"] == policy.fingerprint()
    assert card.data.adacc["actions"] == policy.summary()
    config = json.loads((out / "config.json").read_text())
    assert config["adacc"]["policy_fingerprint"] == policy.fingerprint()

    # Resume from the step-3 checkpoint: the saved policy is restored, no re-profiling.
    model2 = assets.tiny_model("llama", seed=0)
    trainer2 = AdaccTrainer(model=model2, args=_args(tmp_path, budget), train_dataset=Rows(batch))
    ckpt = str(out / "checkpoint-3")
    saved = Policy.load(os.path.join(ckpt, POLICY_FILE))
    trainer2.train(resume_from_checkpoint=ckpt)
    assert trainer2.adacc_session.policy.fingerprint() == saved.fingerprint()
    assert trainer2.state.global_step == 6


def test_arguments_from_the_command_line_and_bad_combinations(tmp_path):
    parser = HfArgumentParser(AdaccTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--adacc",
            "--adacc_memory_budget",
            "20GiB",
            "--adacc_codecs",
            "int4_outlier,bitpack",
            "--report_to",
            "none",
            "--use_cpu",
        ]
    )
    assert args.adacc and args.adacc_memory_budget == "20GiB"
    assert args.adacc_config().codecs == ["int4_outlier", "bitpack"]
    assert "adacc" in args.report_to and args.ddp_find_unused_parameters is False
    json.loads(args.to_json_string())  # still JSON-logged
    with pytest.raises(AdaccError, match="replaces activation checkpointing"):
        AdaccTrainingArguments(output_dir=str(tmp_path), adacc=True, gradient_checkpointing=True)
    with pytest.raises(AdaccError, match="adacc_memory_budget"):
        AdaccTrainingArguments(
            output_dir=str(tmp_path), adacc=True, adacc_memory_budget="20 parsecs"
        )
    with pytest.raises(AdaccError, match="adacc_policy"):
        AdaccTrainingArguments(
            output_dir=str(tmp_path), adacc=True, adacc_policy=str(tmp_path / "missing.json")
        )
    with pytest.raises(AdaccError, match="zip9"):
        AdaccTrainingArguments(output_dir=str(tmp_path), adacc=True, adacc_codecs="zip9")
    plain = AdaccTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert "adacc" not in plain.report_to  # adacc off: nothing changes


def test_budget_below_static_memory_fails_before_training(tmp_path):
    model = assets.tiny_model("gpt2", seed=0)
    batch = assets.tiny_batch("gpt2", model)
    trainer = Trainer(model=model, args=_args(tmp_path, 1024), train_dataset=Rows(batch))
    from adacc_hf.errors import BudgetError

    with pytest.raises(BudgetError, match="smallest feasible budget"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_lora_with_8bit_adamw_trains_and_static_memory_accounts_for_it(tmp_path):
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from adacc_hf.solver import measured_static_memory

    model = assets.tiny_model("llama", seed=0)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    batch = assets.tiny_batch("llama", assets.tiny_config("llama"))
    budget = mixed_budget(model, batch)
    args = _args(tmp_path, budget, optim="adamw_bnb_8bit", save_strategy="no")
    assert args.adacc_config().optimizer == "adamw_bnb_8bit"
    trainer = Trainer(model=model, args=args, train_dataset=Rows(batch))
    trainer.train()
    session = _session(trainer)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    # The static model used for the budget equals what the 8-bit optimizer really holds (with
    # gradients present: the Trainer frees them after each step).
    model(**batch).loss.backward()
    assert session.static_nbytes == measured_static_memory(model, trainer.optimizer)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora)
