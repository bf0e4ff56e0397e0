"""A plain HF Trainer with AdaccTrainingArguments trains under a budget, saves and resumes the
policy, and writes it into the model card and config.json."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from batch_rows import Rows
from transformers import HfArgumentParser, Trainer

from adacc_hf import (
    AdaccError,
    AdaccTrainer,
    AdaccTrainingArguments,
    Policy,
    apply_adacc,
    assets,
    estimate_static_memory,
    measure_step_peak,
    profile_model,
)
from adacc_hf.integrations.trainer import POLICY_FILE, AdaccCallback, run_config
from adacc_hf.solver import budget_between


def mixed_budget(model, batch, fraction=0.4, optimizer="adamw_torch_fused", **kw) -> int:
    """A budget between full recomputation's step peak and no-checkpointing's."""
    static = estimate_static_memory(model, optimizer=optimizer)
    return budget_between(profile_model(model, batch, repeats=1, **kw), static, fraction)


def _args(tmp_path, budget, **kw):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        adacc=True,
        adacc_budget=str(budget),
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


@pytest.mark.parametrize("family", ["llama", "gpt2", pytest.param("t5", marks=pytest.mark.slow)])
def test_plain_trainer_trains_under_a_budget_with_a_mixed_policy(tmp_path, family):
    # Four blocks: on tiny CPU blocks keeping ops costs more dispatch overhead than it saves
    # (priced by the solver), so the mix comes from blocks with and without checkpointing.
    layers = {"llama": "num_hidden_layers", "gpt2": "n_layer", "t5": "num_layers"}[family]
    extra = {"num_decoder_layers": 4} if family == "t5" else {}
    model = assets.tiny_model(family, seed=0, **{layers: 4}, **extra)
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
    # A training step with the run's optimizer, measured: within the budget, near the prediction.
    pred = policy.metadata["predicted"]
    model.train()
    with apply_adacc(model, policy):
        peak = measure_step_peak(model, batch, trainer.optimizer).peak_nbytes
    assert peak <= budget, (peak, budget)
    assert abs(peak - pred["peak_nbytes"]) <= 0.05 * pred["peak_nbytes"], (peak, pred)
    # The checkpoint and the output dir hold the policy; the model is unpatched after training.
    # (the rectifier may have switched after step 3: the checkpoint holds a policy of this model)
    saved = Policy.load(str(tmp_path / "out" / "checkpoint-3" / POLICY_FILE))
    assert saved.groups.keys() == policy.groups.keys()
    assert Policy.load(str(tmp_path / "out" / POLICY_FILE)) == policy
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
    assert "adacc-hf" in card.data.tags
    assert "adacc" not in card.data.to_dict()  # no nested policy dict in the YAML
    assert "## Activation memory (adacc-hf)" in card.text and policy.fingerprint() in card.text
    assert Policy.load(str(out / POLICY_FILE)).fingerprint() == policy.fingerprint()
    config = json.loads((out / "config.json").read_text())
    assert config["adacc"]["policy_fingerprint"] == policy.fingerprint()
    assert len(json.dumps(config["adacc"])) < 400  # a small summary, not the per-op table
    assert not hasattr(model.config, "adacc")  # the live config is left as it was
    trainer.create_model_card(model_name="tiny-adacc")  # twice: one section, not two
    assert ModelCard.load(str(out / "README.md")).text.count("Activation memory (adacc-hf)") == 1

    # Resume from the step-3 checkpoint: the saved policy is restored, no re-profiling.
    model2 = assets.tiny_model("llama", seed=0)
    trainer2 = AdaccTrainer(model=model2, args=_args(tmp_path, budget), train_dataset=Rows(batch))
    ckpt = str(out / "checkpoint-3")
    saved = Policy.load(os.path.join(ckpt, POLICY_FILE))
    trainer2.train(resume_from_checkpoint=ckpt)
    assert trainer2.adacc_session.policy.fingerprint() == saved.fingerprint()
    assert trainer2.adacc_session.profile is not None  # the checkpoint's profile, not a new one
    assert trainer2.state.global_step == 6


def test_callback_works_with_plain_training_arguments_and_resumes(tmp_path):
    """`Trainer(..., callbacks=[AdaccCallback(...)])` with any TrainingArguments (as TRL's
    configs are): it trains under the budget, saves the policy, and a plain Trainer resuming from
    a checkpoint finds the policy there."""
    from transformers import TrainingArguments

    model = assets.tiny_model("llama", seed=0)
    batch = assets.tiny_batch("llama", model)
    budget = mixed_budget(model, batch)
    kw = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    cb = AdaccCallback(budget=budget, adaptive=False)
    trainer = Trainer(
        model=model, args=TrainingArguments(**kw), train_dataset=Rows(batch), callbacks=[cb]
    )
    trainer.train()
    assert cb.session is not None and cb.session.policy is not None
    assert cb.session.config.run.optimizer == trainer.args.optim.value  # read off the run
    with apply_adacc(model, cb.session.policy):
        peak = measure_step_peak(model, batch, trainer.optimizer).peak_nbytes
    assert peak <= budget
    saved = Policy.load(str(tmp_path / "out" / "checkpoint-2" / POLICY_FILE))

    cb2 = AdaccCallback(budget=budget)
    trainer2 = Trainer(
        model=assets.tiny_model("llama", seed=0),
        args=TrainingArguments(**kw),
        train_dataset=Rows(batch),
        callbacks=[cb2],
    )
    trainer2.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert cb2.session.policy.fingerprint() == saved.fingerprint()


def test_importing_adacc_leaves_transformers_globals_untouched():
    """`import adacc_hf` (and its Trainer integration) registers nothing in transformers."""
    import subprocess
    import sys

    code = (
        "from transformers.integrations import integration_utils as iu\n"
        "before = dict(iu.INTEGRATION_TO_CALLBACK)\n"
        "import adacc_hf, adacc_hf.integrations.trainer\n"
        "from adacc_hf import AdaccCallback, AdaccTrainingArguments\n"
        "assert dict(iu.INTEGRATION_TO_CALLBACK) == before, 'globals changed'\n"
        "AdaccTrainingArguments(output_dir='/tmp/x', report_to='none')\n"
        "assert dict(iu.INTEGRATION_TO_CALLBACK) == before, 'adacc=False changed globals'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arguments_from_the_command_line_and_bad_combinations(tmp_path):
    parser = HfArgumentParser(AdaccTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--adacc",
            "--adacc_budget",
            "20GiB",
            "--adacc_codecs",
            "int4_outlier,bitpack",
            "--report_to",
            "none",
            "--use_cpu",
        ]
    )
    assert args.adacc and args.adacc_budget == "20GiB"
    assert args.adacc_config().compression.codecs == ["int4_outlier", "bitpack"]
    assert args.ddp_find_unused_parameters is False
    # What is logged and saved shows the user's report_to, not the integration's name.
    assert json.loads(args.to_json_string())["report_to"] == []
    import pickle

    assert pickle.loads(pickle.dumps(args)).adacc_codecs == ["int4_outlier", "bitpack"]
    assert "adacc" not in pickle.loads(pickle.dumps(args)).to_dict()["report_to"]
    (listed,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--adacc", "--adacc_codecs", "int4_outlier", "bitpack"]
    )
    assert listed.adacc_codecs == ["int4_outlier", "bitpack"]
    with pytest.raises(AdaccError, match="replaces activation checkpointing"):
        AdaccTrainingArguments(output_dir=str(tmp_path), adacc=True, gradient_checkpointing=True)
    with pytest.raises(AdaccError, match="adacc_budget"):
        AdaccTrainingArguments(output_dir=str(tmp_path), adacc=True, adacc_budget="20 parsecs")
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


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_8bit_adamw_trains_and_static_memory_accounts_for_it(tmp_path, lora):
    """LoRA (frozen embeddings) and full fine-tuning, where the Trainer keeps the embeddings'
    8-bit optimizer states in fp32."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from adacc_hf.solver import measured_static_memory

    model = assets.tiny_model("llama", seed=0)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
        model = peft.get_peft_model(model, config)
    batch = assets.tiny_batch("llama", assets.tiny_config("llama"))
    budget = mixed_budget(model, batch)
    args = _args(tmp_path, budget, optim="adamw_bnb_8bit", save_strategy="no")
    assert run_config(args.adacc_config(), args).run.optimizer == "adamw_bnb_8bit"
    trainer = Trainer(model=model, args=args, train_dataset=Rows(batch))
    trainer.train()
    session = _session(trainer)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    # The static model used for the budget equals what the 8-bit optimizer really holds (with
    # gradients present: the Trainer frees them after each step).
    model(**batch).loss.backward()
    assert session.static_nbytes == measured_static_memory(model, trainer.optimizer)
    if lora:
        lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
        assert lora_params
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora_params)


class VariableLengths(torch.utils.data.Dataset):
    """Token rows of lengths 8 to 64 (8x), for dynamic padding."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = [8, 64, 16, 40, 24, 56, 12, 32]
        self.rows = [
            torch.randint(3, 256, (lengths[i % len(lengths)],), generator=g) for i in range(n)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_collate(rows):
    """Dynamic padding: each batch to its own longest row (pad 0, mask 0, labels -100)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_bf16_dynamic_padding_accumulation_and_evaluation_stay_in_budget(tmp_path, caplog):
    """bf16 mixed precision, gradient accumulation 2, evaluation between steps, length-grouped
    dynamic padding: every bucket gets its own plan, no op is unknown to its policy, and a step of
    each planned bucket (two micro-batches, with the run's optimizer) measures within budget."""
    import logging

    from adacc_hf.engine.shapes import padded

    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    data = VariableLengths()
    longest = pad_collate([data[1], data[1]])  # 2 x 64, the run's longest batch
    static = estimate_static_memory(model, optimizer="adamw_torch_fused", mixed_precision="bf16")
    prof = profile_model(model, longest, repeats=1, autocast=torch.bfloat16)
    budget = budget_between(prof, static, 0.3, accumulation=2)
    args = _args(
        tmp_path,
        budget,
        bf16=True,
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        train_sampling_strategy="group_by_length",
        max_steps=6,
        save_strategy="no",
        per_device_eval_batch_size=2,
    )
    trainer = AdaccTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=pad_collate
    )
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        trainer.train()
    session = trainer.adacc_session
    assert "not in the policy" not in caplog.text
    assert not session.handle.problems, session.handle.problems[:3]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[:2000]
    assert len(session.plans) >= 2  # several buckets, planned as they came
    assert sum("eval_loss" in e for e in trainer.state.log_history) >= 2
    planned = [e for e in trainer.state.log_history if "adacc/event_policy" in e]
    assert len(planned) >= len(session.plans)  # each plan logged (and any evolution switch)
    opt = trainer.optimizer
    model.train()
    for key, plan in session.plans.items():
        batch = padded(pad_collate([data[0], data[2]]), key, 0)
        with apply_adacc(model, plan.policy):
            peak = measure_step_peak(model, [batch, batch], opt, autocast=torch.bfloat16)
        assert peak.peak_nbytes <= budget, (key, peak.peak_nbytes, budget)
    session.close()


@pytest.mark.slow  # ~20 s; compiled plans are held by tests/runtime/test_compile.py
def test_torch_compile_trains_the_solved_policy_compiled(tmp_path):
    """``--torch_compile`` with adacc: the Trainer compiles the model whole (Accelerate), the
    session profiles its blocks, head and step compiled with the same backend
    (`profiler.compiled`) and plans without offload; the compiled steps run the policy (kept ops
    as selective-checkpoint tags, compressed ones through `saved_codecs`) and train."""
    from torch._dynamo.utils import counters

    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    batch = assets.tiny_batch("llama", model)
    budget = mixed_budget(model, batch)
    args = _args(
        tmp_path,
        budget,
        torch_compile=True,
        torch_compile_backend="aot_eager",
        max_steps=4,
        save_strategy="no",
        adacc_adaptive=False,
    )
    assert args.adacc_config().compilation.compile == "aot_eager"
    with pytest.raises(AdaccError, match="offload has no compiled form"):
        _args(tmp_path, budget, torch_compile=True, adacc_offload=True).adacc_config()
    counters.clear()
    try:
        trainer = Trainer(model=model, args=args, train_dataset=Rows(batch))
        trainer.train()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    session = _session(trainer)
    assert session.profile.compiled["backend"] == "aot_eager"
    kinds = {
        a.kind
        for g in session.policy.groups.values()
        for v in g.variants
        for a in v.actions.values()
    }
    assert "offload" not in kinds, kinds
    assert graphs >= 1, "the Trainer's model was not compiled"
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    pred = session.policy.metadata["predicted"]["peak_nbytes"]
    assert pred <= budget


def test_old_option_names_still_work_with_a_warning_and_every_option_is_named_after_its_field():
    import dataclasses

    from adacc_hf import AdaccConfig
    from adacc_hf.engine.options import OPTION_GROUP
    from adacc_hf.integrations.arguments import RENAMED

    with pytest.warns(FutureWarning, match="adacc_memory_budget is renamed adacc_budget"):
        a = AdaccTrainingArguments(
            output_dir="out", adacc=True, adacc_memory_budget="3GiB", use_cpu=True
        )
    assert a.adacc_budget == "3GiB" and a.adacc_config().budget == "3GiB"
    with pytest.raises(AdaccError, match="give only adacc_budget"):
        AdaccTrainingArguments(
            output_dir="out", adacc=True, adacc_budget="2GiB", adacc_memory_budget="3GiB"
        )
    # one name per option: every adacc_* flag is adacc_<a group's field>, and every group field
    # has its flag (compile: the Trainer's own --torch_compile)
    flags = {
        f.name[len("adacc_") :]
        for f in dataclasses.fields(AdaccTrainingArguments)
        if f.name.startswith("adacc_") and f.name not in RENAMED
    }
    assert flags - {"budget", "policy"} == set(OPTION_GROUP) - {"compile"}
    assert hasattr(a, "torch_compile")
    # and each flag fills its option, with the option's own default
    config = AdaccTrainingArguments(output_dir="out", adacc=True, use_cpu=True).adacc_config()
    assert config == AdaccConfig()
