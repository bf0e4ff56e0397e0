"""Options as typed groups, the facts of the run apart (issue 53): a config round trips through
its dict, copies and pickle; an option by name and in its group make the same config; the old
flat ways (a fact passed as an option, a flat attribute read) still work for a release with a
warning; each entry point reads the facts off the run; the library itself uses none of the old
ways (and pyproject's ``filterwarnings`` holds the whole suite to that)."""

from __future__ import annotations

import copy
import json
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch

from adacc_hf import (
    AdaccConfig,
    CodecOptions,
    CompileOptions,
    MemoryOptions,
    OffloadOptions,
    RunFacts,
    SolverOptions,
    TrackingOptions,
    assets,
    prepare,
)
from adacc_hf.engine.options import GROUPS, OPTION_GROUP, option_help
from adacc_hf.errors import AdaccError, AdaccFutureWarning


def _rich() -> AdaccConfig:
    """A config with something other than the default in every group."""
    return AdaccConfig(
        budget="3GiB",
        memory=MemoryOptions(headroom=0.1, allocator="default", max_seq_len=128),
        compression=CodecOptions(codecs=["int4_outlier", "bitpack"], max_grad_error=None),
        offloading=OffloadOptions(offload=True, offload_host_cap="1GiB"),
        solving=SolverOptions(head="auto", profile_repeats=1),
        tracking=TrackingOptions(adaptive=False, max_tracking_interval=8, profile_from="none"),
        run=RunFacts(optimizer="sgd", zero_stage=2, world_size=4, zero_buckets=10),
    )


def test_a_config_round_trips_through_its_dict_json_copies_and_pickle():
    cfg = _rich()
    data = cfg.to_dict()
    assert data["memory"]["max_seq_len"] == 128 and data["run"]["zero_stage"] == 2
    assert AdaccConfig.from_dict(data) == cfg
    assert AdaccConfig.from_dict(json.loads(json.dumps(data, sort_keys=True))) == cfg
    assert AdaccConfig(**data) == cfg
    for other in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg and other.to_dict() == data
    compiled = AdaccConfig(compile=True)  # normalised values round trip as they are
    assert AdaccConfig.from_dict(compiled.to_dict()) == compiled


def test_an_option_by_name_and_in_its_group_give_the_same_config():
    by_name = AdaccConfig(
        budget="3GiB",
        headroom=0.1,
        allocator="default",
        max_seq_len=128,
        codecs=["int4_outlier", "bitpack"],
        max_grad_error=None,
        offload=True,
        offload_host_cap="1GiB",
        head="auto",
        profile_repeats=1,
        adaptive=False,
        max_tracking_interval=8,
        profile_from="none",
        run=RunFacts(optimizer="sgd", zero_stage=2, world_size=4, zero_buckets=10),
    )
    assert by_name == _rich()
    assert AdaccConfig(head="chunked").solving == SolverOptions(head="chunked")
    assert set(OPTION_GROUP.values()) == set(GROUPS)


def test_an_option_given_both_by_name_and_in_its_group_is_an_error_naming_it():
    with pytest.raises(AdaccError, match="max_seq_len given both by name and in memory="):
        AdaccConfig(max_seq_len=64, memory=MemoryOptions(headroom=0.1))
    both = pytest.raises(AdaccError, match="zero_stage given both by name and in run=")
    with both, pytest.warns(AdaccFutureWarning):
        AdaccConfig(zero_stage=2, run=RunFacts())
    with pytest.raises(TypeError, match="no option 'max_seqlen'.*'max_seq_len'"):
        AdaccConfig(max_seqlen=64)


def test_a_fact_passed_as_an_option_warns_and_still_counts():
    with pytest.warns(
        AdaccFutureWarning,
        match=r"optimizer is a fact of the run.*run=RunFacts\(optimizer=\.\.\.\)",
    ):
        cfg = AdaccConfig(optimizer="sgd")
    assert cfg.run == RunFacts(optimizer="sgd")
    assert issubclass(AdaccFutureWarning, FutureWarning)
    model = assets.tiny_model("gpt2", seed=0, n_layer=2)
    with pytest.warns(
        AdaccFutureWarning, match="zero_stage, world_size are facts of the run"
    ) as caught:
        session = prepare(model, "1GiB", zero_stage=2, world_size=2)
    assert caught[0].filename == __file__  # pointed at the caller's line
    try:
        assert (session.config.run.zero_stage, session.config.run.world_size) == (2, 2)
    finally:
        session.close()


def test_reading_or_setting_a_flat_attribute_warns_and_names_the_group():
    cfg = AdaccConfig(max_grad_error=0.2)
    with pytest.warns(AdaccFutureWarning, match=r"max_grad_error is AdaccConfig\.compression\."):
        assert cfg.max_grad_error == 0.2
    with pytest.warns(AdaccFutureWarning, match=r"AdaccConfig\.run\.optimizer"):
        assert cfg.optimizer == "adamw_torch"
    with pytest.warns(AdaccFutureWarning, match=r"AdaccConfig\.run\.static_options"):
        assert cfg.static_options() == cfg.run.static_options()
    with pytest.warns(AdaccFutureWarning, match=r"AdaccConfig\.memory\.max_seq_len"):
        cfg.max_seq_len = 32
    assert cfg.memory.max_seq_len == 32
    with pytest.raises(AttributeError):
        cfg.no_such_option  # noqa: B018


def test_replace_and_with_run_return_checked_copies():
    cfg = AdaccConfig(budget="2GiB", codecs=["int4_naive"])
    other = cfg.replace(head="auto", budget=5)
    assert (other.solving.head, other.budget, other.compression) == ("auto", 5, cfg.compression)
    assert cfg.solving.head == "full"  # unchanged
    assert cfg.replace(memory=MemoryOptions(max_seq_len=8)).memory.max_seq_len == 8
    with pytest.raises(AdaccError, match=r"zero_stage is a fact of the run: config\.with_run"):
        cfg.replace(zero_stage=2)
    with pytest.raises(AdaccError, match="head must be"):
        cfg.replace(head="sideways")
    assert cfg.with_run(gradient_accumulation_steps=4).run.gradient_accumulation_steps == 4
    assert cfg.with_run(RunFacts(ddp=True)).run == RunFacts(ddp=True)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: MemoryOptions(headroom=0.7), "headroom must be in"),
        (lambda: MemoryOptions(allocator="expandible"), "allocator must be"),
        (lambda: MemoryOptions(max_seq_len=0), "max_seq_len must be"),
        (lambda: CodecOptions(codecs=["int3"]), "adacc codecs"),
        (lambda: CodecOptions(codec_backends=[]), "codec_backends"),
        (lambda: CodecOptions(max_grad_error=-1), "max_grad_error"),
        (lambda: OffloadOptions(offload_host_cap="lots"), "offload_host_cap"),
        (lambda: CompileOptions(compile=3), "compile must be"),
        (lambda: SolverOptions(head="sideways"), "head must be"),
        (lambda: TrackingOptions(max_tracking_interval=0), "max_tracking_interval"),
        (lambda: TrackingOptions(profile_from="/no/such/dir"), "profile_from"),
        (lambda: RunFacts(zero_stage=4), "zero_stage"),
        (lambda: RunFacts(mixed_precision="fp8"), "mixed_precision"),
        (lambda: RunFacts(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (lambda: AdaccConfig(compile="inductor", offload=True), "offload has no compiled form"),
    ],
)
def test_each_group_checks_its_own_options(make, match):
    with pytest.raises(AdaccError, match=match):
        make()


def test_groups_are_immutable_and_compile_keeps_offload_off():
    cfg = AdaccConfig(compile=True)
    assert (cfg.compilation.compile, cfg.offloading.offload) == ("inductor", False)
    with pytest.raises(AttributeError):
        cfg.memory.max_seq_len = 4  # type: ignore[misc]


def test_the_trainer_reads_the_facts_off_its_arguments():
    args = SimpleNamespace(
        optim="adamw_bnb_8bit", bf16=True, gradient_accumulation_steps=3, world_size=1
    )
    facts = RunFacts.from_training_args(args, base=RunFacts(zero_buckets=7))
    assert facts == RunFacts(
        optimizer="adamw_bnb_8bit",
        fp32_embeddings=True,
        mixed_precision="bf16",
        gradient_accumulation_steps=3,
        zero_buckets=7,  # not said by the arguments: the base's stands
    )


def test_prepare_reads_the_facts_off_the_loop():
    """The optimizer's name off the object it steps, the accumulation off an initialised
    Accelerator (or the keyword); `run=` states them, what the loop tells still counts."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    model = assets.tiny_model("gpt2", seed=0, n_layer=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        Accelerator(cpu=True, gradient_accumulation_steps=4)
        session = prepare(model, "1GiB", optimizer=opt)
        assert session.config.run == RunFacts(optimizer="sgd", gradient_accumulation_steps=4)
        session.close()
        session = prepare(model, "1GiB", optimizer=opt, gradient_accumulation_steps=2)
        assert session.config.run.gradient_accumulation_steps == 2
        session.close()
        session = prepare(model, "1GiB", optimizer=opt, run=RunFacts(zero_stage=3, world_size=2))
        assert session.config.run == RunFacts(optimizer="sgd", zero_stage=3, world_size=2)
        session.close()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_every_option_flag_has_its_group_text_as_help():
    from adacc_hf import AdaccTrainingArguments

    fields = {f.name: f for f in AdaccTrainingArguments.__dataclass_fields__.values()}
    for name in OPTION_GROUP:
        if name != "compile":  # the Trainer's --torch_compile
            assert fields[f"adacc_{name}"].metadata["help"] == option_help(name), name
            assert "`" not in option_help(name)


def test_the_library_itself_uses_no_old_way():
    """A short session (profile, solve, patch, a step, a tracking step, its state saved) with every
    FutureWarning an error."""
    model = assets.tiny_model("gpt2", seed=0, n_layer=2)
    batch = assets.tiny_batch("gpt2", model, batch_size=2, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        session = prepare(
            model, "4GiB", batch, optimizer=opt, codecs=["int4_naive"], profile_repeats=1
        )
        try:
            for step in (1, 2):
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                session.step_done(step)
            state = session.state_dict()
        finally:
            session.close()
    assert AdaccConfig.from_dict(state["config"]) == session.config
