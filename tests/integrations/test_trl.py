"""TRL's `SFTTrainer` with `AdaccCallback`: dynamic padding and padding-free (BFD-packed) batches
train a tiny LLaMA under a budget; every bucket gets a plan and its measured step peak fits.
SFTConfig's default activation checkpointing is taken over (bit-identical to TRL without
checkpointing under a lossless policy), asked for explicitly it is an error, and adacc's chunked
head stands down for TRL's fused one.

Offline: a word-level tokenizer built here, a tiny random-init model, text rows of set lengths.
TRL 1.16 patches the model's forward with its own chunked LM head (``fused_lm_head=True``); the
session profiles the forward the trainer runs, so its budgets here come from that forward too.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

from adacc_hf import (  # noqa: E402
    AdaccError,
    apply_adacc,
    assets,
    estimate_static_memory,
    measure_step_peak,
)
from adacc_hf.engine.shapes import is_packed, padded, shape_key  # noqa: E402
from adacc_hf.integrations.callback import AdaccCallback  # noqa: E402
from adacc_hf.integrations.run_facts import longest_sequence  # noqa: E402

WORDS = [f"w{i}" for i in range(250)]
#: Row lengths in words (the tokenizer adds EOS): two length buckets (32, 64) with padding.
LENGTHS = [63, 30, 60, 25, 28, 62, 20, 57]
#: What TRL 1.16's SFTTrainer adds to every training forward (its own chunked LM head).
#: Wide enough that block activations weigh against TRL's LM-head buffer ([tokens, 32768] fp32).
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
TRL_KWARGS = {"fused_lm_head": True, "use_cache": False}


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's 256 ids: 0 pad, 1 bos, 2 eos, 3 unk."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
    )


def texts(n: int = 32, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, len(WORDS), (LENGTHS[i % len(LENGTHS)],), generator=g).tolist()
        rows.append(" ".join(WORDS[j] for j in ids))
    return datasets.Dataset.from_dict({"text": rows})


#: Every SFTConfig here: a quiet, seeded CPU run that logs each step and saves nothing.
CPU_RUN = dict(
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
)


def sft_config(tmp_path, **kw) -> trl.SFTConfig:
    no_ckpt = (
        {"activation_checkpointing": False}
        if "activation_checkpointing" in {f.name for f in dataclasses.fields(trl.SFTConfig)}
        else {"gradient_checkpointing": False}
    )
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_length=64,
        **CPU_RUN,
        **no_ckpt,
    )
    defaults.update(kw)
    return trl.SFTConfig(**defaults)


def amp(args) -> torch.dtype | None:
    """The run's autocast: SFTConfig turns bf16 on by default (on CPU too)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def budget_for(model, trainer, key) -> int:
    """30 % of the way from HF full checkpointing's step peak to no checkpointing's, both
    measured on the run's longest bucket `key` with the forward SFTTrainer runs (its LM head, its
    autocast), plus the optimizer's states and step (the run's optimizer does not exist yet)."""
    args = trainer.args
    sample = {**padded(next(iter(trainer.get_train_dataloader())), key, 0), **TRL_KWARGS}
    on = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.23
    off = getattr(model, "activation_checkpointing_disable", None)
    on, off = on or model.gradient_checkpointing_enable, off or model.gradient_checkpointing_disable
    on()
    peaks = [measure_step_peak(model, sample, autocast=amp(args)).peak_nbytes]
    off()
    peaks.append(measure_step_peak(model, sample, autocast=amp(args)).peak_nbytes)
    model.zero_grad(set_to_none=True)
    mp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp(args))
    static = estimate_static_memory(model, optimizer=str(args.optim.value), mixed_precision=mp)
    return int(peaks[0] + 0.3 * (peaks[1] - peaks[0])) + static.optimizer + static.optimizer_step


def train_and_check(tmp_path, caplog, key_of_longest, **config):
    """Train with Adacc under a budget; check loss, plans, warnings and each bucket's peak."""
    model = assets.tiny_model("llama", seed=0, **MODEL)
    args = sft_config(tmp_path, **config)
    callback = AdaccCallback(budget="1GiB")  # budget replaced below, before training
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=texts(),
        processing_class=tokenizer(),
        callbacks=[callback],
    )
    budget = budget_for(model, trainer, key_of_longest)
    callback.config = callback.config.replace(budget=budget)
    seen: list[tuple] = []
    batches: dict[tuple, dict] = {}

    def record(module, a, kwargs):  # the run's own forwards, not profiling's (a tiny bucket)
        if module.training and "labels" in kwargs and not callback.session.ctx.planning:
            key = shape_key(kwargs, False, callback.session.config.memory.max_seq_len)
            seen.append(key)
            batches.setdefault(key, {k: v for k, v in kwargs.items()})

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        trainer.train()
    hook.remove()
    session = callback.session
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == args.max_steps and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] != losses[0], losses
    assert not session.handle.problems, session.handle.problems[:3]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[:2000]
    assert seen and set(seen) <= set(session.plans), (seen, list(session.plans))
    assert key_of_longest in session.plans  # planned before the first step
    assert all(p.policy is not None and p.policy.groups for p in session.plans.values())
    model.train()
    for key, batch in batches.items():  # each bucket's step, at its edge, with the run's AdamW
        with apply_adacc(model, session.plans[key].policy):
            peak = measure_step_peak(
                model, padded(batch, key, 0), trainer.optimizer, autocast=amp(args)
            )
        assert peak.peak_nbytes <= budget, (key, peak.peak_nbytes, budget)
    return trainer, session, seen


@pytest.mark.slow  # 50-60 s on the shared 2-core machine; the takeover tests run SFTTrainer by default
def test_sft_trainer_with_dynamic_padding_trains_within_budget(tmp_path, caplog):
    """Dynamic padding (TRL's collator pads each batch to its longest row): the longest bucket
    (TRL's max_length) is planned before the first step, each length bucket when it comes."""
    _, session, seen = train_and_check(tmp_path, caplog, (2, 64, 1))
    assert session.config.memory.max_seq_len == 64
    assert all(k[0] == 2 for k in seen)


@pytest.mark.slow  # ~50 s: the packed bucket is the longest (make test-all runs it)
def test_sft_trainer_padding_free_packing_trains_within_budget(tmp_path, caplog):
    """BFD packing (padding-free: each batch is one row [1, total tokens] with position ids
    restarting per sequence, block-diagonal SDPA mask on CPU): the longest batch is
    per_device_train_batch_size x max_length tokens and is planned before the first step."""
    trainer, session, seen = train_and_check(tmp_path, caplog, (1, 128, 1), packing=True)
    assert trainer.padding_free
    assert session.config.memory.max_seq_len == 2 * 64
    assert seen and all(k[0] == 1 and k[-1] == 1 for k in seen), seen


def test_sft_trainer_steps_count_the_batch_the_loader_fetches_ahead(tmp_path):
    """Every step of an SFTTrainer run, metered by the independent storage meter (`step_meter`:
    live storages, profiling included), stays within the budget and within 5 % of its plan's
    prediction. Accelerate's loader (every Trainer's) fetches the next batch before it yields
    this one, so on a CPU device that batch is alive beside every step, and the plans count it
    (`StaticMemory.batches_ahead`). Rows are cut to max_length: every batch is its bucket's edge
    and the plan has no padding to spare. Without the batch ahead (12 KB here) steps 2 and 3
    measured 2 KB over their prediction (7 KB over the budget where the plan filled it)."""
    from step_meter import train_metered

    from adacc_hf.runtime.peak import batch_nbytes

    rows, length = 8, 64
    model = assets.tiny_model("llama", seed=0, **{**MODEL, "num_hidden_layers": 2})
    g = torch.Generator().manual_seed(0)
    words = [torch.randint(0, len(WORDS), (length + 16,), generator=g) for _ in range(4 * rows)]
    data = datasets.Dataset.from_dict({"text": [" ".join(WORDS[j] for j in w) for w in words]})
    args = sft_config(
        tmp_path, max_steps=2, bf16=False, per_device_train_batch_size=rows, max_length=length
    )
    callback = AdaccCallback(budget="1GiB", profile_repeats=1, codecs=[])  # budget set below
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
        callbacks=[callback],
    )
    first = next(iter(trainer.get_train_dataloader()))
    assert first["input_ids"].shape == (rows, length)  # at the bucket's edge
    budget = budget_for(model, trainer, (rows, length, 1))
    callback.config = callback.config.replace(budget=budget)
    measured, planned = train_metered(trainer, model, callback)
    pairs = list(zip(measured, planned, strict=True))
    print(f"budget {budget}: measured, predicted {pairs}")
    assert len(pairs) == args.max_steps
    assert max(measured) <= budget, (budget, pairs)
    # The meter sees neither the generator state a checkpoint stashes (5 KB per checkpointed
    # block, made outside torch's dispatcher) nor an op's inner temporaries; the prediction
    # counts both, so it bounds what the meter reads.
    assert all(m <= p <= 1.05 * m for m, p in pairs), pairs
    assert callback.session.static.batches_ahead == batch_nbytes(first.values())


def test_padding_free_batches_bucket_and_pad_as_packed_sequences():
    """A padding-free batch counts as masked when it packs several sequences; padded to its
    bucket's edge, the padding is one more sequence and the varlen boundaries follow. A single
    sequence stays one sequence (its positions continue)."""
    collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        pad_token_id=0, padding_free=True
    )
    two = collate([{"input_ids": list(range(4, 14))}, {"input_ids": list(range(4, 24))}])
    assert two["input_ids"].shape == (1, 30) and "attention_mask" not in two
    key = shape_key(two, False)
    assert key == (1, 32, 1)
    out = padded(two, key, 0)
    assert out["position_ids"][0, 30:].tolist() == [0, 1]
    assert out["cu_seq_lens_q"].tolist() == [0, 10, 30, 32]
    assert out["max_length_q"] == out["max_length_k"] == 20
    assert out["seq_idx"][0, 30:].tolist() == [2, 2]
    assert out["labels"][0, 30:].tolist() == [-100, -100]
    assert shape_key(out, False) == key

    one = collate([{"input_ids": list(range(4, 34))}])
    assert not is_packed(one) and shape_key(one, False) == (1, 32, 0)
    out = padded(one, (1, 40, 0), 0)
    assert out["position_ids"][0].tolist() == list(range(40)) and not is_packed(out)
    assert out["cu_seq_lens_k"].tolist() == [0, 40] and out["max_length_k"] == 40
    assert out["seq_idx"][0].tolist() == [0] * 40


def test_longest_sequence_of_padding_free_runs(tmp_path):
    """Padding-free batches hold up to per_device_train_batch_size rows' tokens."""
    plain = sft_config(tmp_path, per_device_train_batch_size=3, max_length=64)
    packed = sft_config(tmp_path, per_device_train_batch_size=3, packing=True, max_length=64)
    wrapped = sft_config(
        tmp_path, per_device_train_batch_size=3, packing=True, packing_strategy="wrapped"
    )
    free = sft_config(tmp_path, per_device_train_batch_size=3, padding_free=True, max_length=None)
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * 10, [1] * 50]})
    assert longest_sequence(plain) == 64
    assert longest_sequence(packed) == 3 * 64
    assert longest_sequence(wrapped) == 64  # fixed rows of max_length, not flattened
    assert longest_sequence(free, None, rows) == 3 * 50


# ------------------------------------------------------------------ takeover of SFTConfig's default
#: A short run: 2 steps of dynamic padding over two length buckets, SFTConfig's bf16 default.
SHORT = dict(max_steps=2, per_device_train_batch_size=2, max_length=64, disable_tqdm=True)
TAKEOVER = "adacc takes over activation checkpointing: SFTConfig"


class _Grads(TrainerCallback):
    """Each optimizer step's gradients (after clipping), copied."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append([p.grad.clone() for p in model.parameters()])


def sft_run(tmp_path, callbacks=(), *, late=(), **config) -> tuple[trl.SFTTrainer, _Grads]:
    """A short SFTTrainer run of the default tiny LLaMA: SFTConfig's defaults (activation
    checkpointing on) unless `config` says otherwise; `late` callbacks join after the trainer is
    built (they miss `on_init_end`)."""
    grads = _Grads()
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), **CPU_RUN, **{**SHORT, **config})
    trainer = trl.SFTTrainer(
        model=assets.tiny_model("llama", seed=0),
        args=args,
        train_dataset=texts(8),
        processing_class=tokenizer(),
        callbacks=[*callbacks, grads],
    )
    for cb in late:
        trainer.add_callback(cb)
    trainer.train()
    return trainer, grads


def losses_of(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """TRL without Adacc and without checkpointing: the run every takeover must reproduce."""
    trainer, grads = sft_run(tmp_path_factory.mktemp("ref"), activation_checkpointing=False)
    return losses_of(trainer), grads.steps, [p.detach().clone() for p in trainer.model.parameters()]


def assert_bit_identical(trainer, grads, reference) -> None:
    losses, steps, params = reference
    assert losses_of(trainer) == losses and len(losses) == SHORT["max_steps"]
    assert len(grads.steps) == len(steps)
    for ours, theirs in zip(grads.steps, steps, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), params, strict=True))


def full_recompute_policy():
    """Adacc's full recomputation (every op recomputed: lossless), traced under SFTConfig's
    default bf16 autocast; a fixed policy skips profiling and solving."""
    from adacc_hf import trace_model
    from adacc_hf.policy import builders

    model = assets.tiny_model("llama", seed=0)
    return builders.uniform(trace_model(model, autocast=torch.bfloat16), "recompute")


def takeover_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(TAKEOVER)]


@pytest.mark.parametrize("when", ["built", "added_later"])
def test_sft_config_default_checkpointing_is_taken_over_bit_identically(
    tmp_path, caplog, reference, when
):
    """SFTConfig turns activation checkpointing on by default: the callback switches the run's
    own off (one info line) and Adacc's recompute trains bit-identically to TRL with no
    checkpointing: losses, every step's gradients, final parameters. A callback given to the
    trainer acts before `train()` enables anything; one added later undoes what `train()` did
    (checkpointing and its input-gradient hooks)."""
    callback = AdaccCallback(policy=full_recompute_policy())
    hooks_seen: list = []
    funcs_seen: set = set()

    class Seen(TrainerCallback):  # the model's checkpointing while adacc trains
        def on_step_end(self, args, state, control, model=None, **kwargs):
            hooks_seen.append(getattr(model, "_require_grads_hooks", None))
            for layer in model.model.layers:
                assert layer.gradient_checkpointing
                funcs_seen.add(type(layer._gradient_checkpointing_func).__module__)

    cbs, late = ([callback], [Seen()]) if when == "built" else ((), [callback, Seen()])
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        trainer, grads = sft_run(tmp_path, cbs, late=late)
    assert len(takeover_lines(caplog)) == 1, caplog.text[-2000:]
    args = trainer.args
    assert not args.gradient_checkpointing and not getattr(args, "activation_checkpointing", 0)
    assert hooks_seen and not any(hooks_seen)  # no input-gradient hooks while adacc trained
    assert funcs_seen == {"adacc_hf.runtime.checkpoint"}, funcs_seen  # adacc's, not torch's
    assert callback.session.policy.metadata["source"] == "uniform:recompute"
    assert_bit_identical(trainer, grads, reference)
    model = trainer.model  # undone after training: neither adacc's nor transformers' checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_lossless_solved_policy_under_sft_defaults_matches_trl(tmp_path, caplog, reference):
    """Profiled and solved under SFTConfig's defaults with no codec (``codecs=[]``: retain or
    recompute only), Adacc trains bit-identically to TRL without checkpointing."""
    callback = AdaccCallback(budget="1GiB", codecs=[])
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        trainer, grads = sft_run(tmp_path, [callback])
    assert len(takeover_lines(caplog)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[-2000:]
    assert callback.session.plans
    assert_bit_identical(trainer, grads, reference)


@pytest.mark.parametrize("source", ["config", "policy"])
def test_chunked_head_stands_down_for_trls_fused_head(tmp_path, caplog, reference, source):
    """TRL 1.16's SFTTrainer computes its default ``loss_type="nll"`` loss (and the entropy and
    accuracy metrics) with its own fused LM head, chunk by chunk, without logits. Adacc's chunked
    head (asked for by the config or carried by a saved policy) stands down with an info line
    instead of chunking twice or failing, and the losses are TRL's, bit for bit."""
    if source == "config":
        callback = AdaccCallback(budget="1GiB", codecs=[], head="chunked")
    else:
        policy = full_recompute_policy()
        policy.head = "chunked"
        callback = AdaccCallback(policy=policy)
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        trainer, grads = sft_run(tmp_path, [callback])
    notes = [r.getMessage() for r in caplog.records if "TRL's fused LM head" in r.getMessage()]
    assert len(notes) == 1 and "stands down" in notes[0], caplog.text[-2000:]
    assert callback.session.handle is None or callback.session.handle.head is None
    assert_bit_identical(trainer, grads, reference)
    # every training entry keeps TRL's metrics (adacc's own events are entries of their own)
    entries = [e for e in trainer.state.log_history[:-1] if "loss" in e]
    assert entries and all(e.get("mean_token_accuracy") is not None for e in entries)


def test_explicit_checkpointing_with_adacc_is_refused_saying_what_to_change(tmp_path):
    """Asked for explicitly, transformers' own checkpointing and Adacc stop at once, saying which
    setting to change: AdaccTrainingArguments with either name, TrainingArguments (whose default
    is off) with AdaccCallback, and SFTConfig with checkpointing kwargs of the user's own."""
    from transformers import Trainer, TrainingArguments

    from adacc_hf import AdaccTrainingArguments

    out = str(tmp_path / "out")
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        with pytest.raises(AdaccError, match="replaces activation checkpointing: drop --"):
            AdaccTrainingArguments(output_dir=out, adacc=True, **{name: True})
    args = TrainingArguments(output_dir=out, activation_checkpointing=True, use_cpu=True)
    model = assets.tiny_model("llama", seed=0)
    batch = assets.tiny_batch("llama", model)
    with pytest.raises(AdaccError, match="pass activation_checkpointing=False"):
        Trainer(model=model, args=args, train_dataset=[batch], callbacks=[AdaccCallback()])
    args = trl.SFTConfig(
        output_dir=out,
        use_cpu=True,
        report_to="none",
        activation_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": False},
    )
    with pytest.raises(AdaccError, match="kwargs with every_n_layers"):
        trl.SFTTrainer(
            model=model,
            args=args,
            train_dataset=texts(4),
            processing_class=tokenizer(),
            callbacks=[AdaccCallback()],
        )


def test_arguments_taking_sft_configs_default_switch_it_off_with_one_line(tmp_path, caplog):
    """Arguments combining SFTConfig and AdaccTrainingArguments inherit SFTConfig's default:
    it is switched off when they are made (one info line); typed with the new name it is an
    error. (Typed as ``gradient_checkpointing=True`` it equals the default and reads as one.)"""
    import dataclasses as dc

    from adacc_hf import AdaccTrainingArguments

    @dc.dataclass
    class SFTAdaccConfig(trl.SFTConfig, AdaccTrainingArguments):
        pass

    out = str(tmp_path / "out")
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        args = SFTAdaccConfig(output_dir=out, adacc=True, use_cpu=True, report_to="none")
    assert not args.gradient_checkpointing and not args.activation_checkpointing
    lines = [r.getMessage() for r in caplog.records if "takes over" in r.getMessage()]
    assert len(lines) == 1 and "SFTAdaccConfig" in lines[0], caplog.text
    assert SFTAdaccConfig(output_dir=out, use_cpu=True).gradient_checkpointing  # adacc off
    with pytest.raises(AdaccError, match="replaces activation checkpointing"):
        SFTAdaccConfig(output_dir=out, adacc=True, use_cpu=True, activation_checkpointing=True)
