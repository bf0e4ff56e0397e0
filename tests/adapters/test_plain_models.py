"""Any PyTorch model with repeated blocks: `prepare(model, budget, batch, blocks=..., loss=...)`.

Three models written without transformers (`plain_nets`: nanoGPT's GPT, torchtitan's LLaMA with
RoPE and GQA, a ViT with a classifier head) and torchvision's VisionTransformer where torchvision
imports:

- gradients bit-identical to the unpatched model's under retain-everything and
  recompute-everything (the runtime reaches plain blocks through its own forward hook, which is
  gone after `close`);
- an Accelerate loop (``Accelerator(cpu=True)``, each step through ``session.run_step``) trained
  through `prepare` at three budgets, every step's peak metered by the storage meter
  (`runtime.capacity.DeviceMeter`, planning included) within the budget, and every step after
  the first (which plans) within 5 % of the prediction;
- bad input refused before any profiling, saying what to change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from plain_nets import CASES, GPT, Block, Case, Transformer, torchvision_missing

import adacc_hf.engine.profiles as profiling
from adacc_hf import (
    Action,
    Policy,
    UnsupportedModelError,
    estimate_static_memory,
    prepare,
    trace_model,
    uniform_policy,
)
from adacc_hf.adapters import plain
from adacc_hf.policy.builders import from_trace
from adacc_hf.runtime.capacity import DeviceMeter
from adacc_hf.runtime.peak import live_state_nbytes
from adacc_hf.solver import budget_between

#: Exact actions only (no codec profiled), one timed run per op: the plans are what is tested.
QUICK = dict(codecs=[], profile_repeats=1, adaptive=False, optimizer="adamw_torch")
FRACTIONS = (0.2, 0.5, 0.8)  # of the way from full recomputation's step peak to no checkpointing
STEPS = 3


def case_of(name: str) -> Case:
    if name == "torchvision_vit" and (why := torchvision_missing()) is not None:
        pytest.skip(why)
    return CASES[name]


def built(case: Case, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = case.build().train()
    return model, case.batch(torch.Generator().manual_seed(seed))


def gradients(case: Case, model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    case.step_loss(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def policy_of(kind: str, model: torch.nn.Module, batch: dict) -> Policy:
    """Every block checkpointed: every op's output kept (``retain``: the runtime's dispatch modes
    hand each back in backward), or none (``recompute``: full recomputation)."""
    if kind == "recompute":
        return uniform_policy(model, "recompute", batch)
    return from_trace(trace_model(model, batch), lambda op: Action("retain"), source="test")


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_are_bitwise_the_unpatched_models_under_retain_and_recompute(name):
    case = case_of(name)
    model, batch = built(case)
    reference = gradients(case, model, batch)
    blocks = case.blocks(model)
    plain.register(model, blocks, case.loss)  # for uniform_policy's trace
    block_modules = [m for _, m in plain.plain_model(model).adapter.find_blocks(model)]
    for kind in ("retain", "recompute"):
        policy = policy_of(kind, model, batch)
        session = prepare(model, "auto", batch, blocks=blocks, loss=case.loss, policy=policy)
        try:
            got = gradients(case, model, batch)
            kept = session.handle.cached_bytes()
            assert not session.handle.unknown_ops and not session.handle.problems
        finally:
            session.close()
        assert len(kept) == len(block_modules) > 1  # every block ran the runtime
        assert all((n > 0) == (kind == "retain") for n in kept.values()), (kind, kept)
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True)), kind
    assert not any("forward" in vars(m) for m in block_modules)  # the hook is gone


@contextlib.contextmanager
def accelerator() -> Iterator:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield Accelerator(cpu=True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def accelerate_loop_at_three_budgets(case: Case, tmp_path) -> None:
    model, batch = built(case)
    with accelerator() as acc:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        blocks = case.blocks(model)
        # the budgets' window, from one profile the three runs plan from (`profile_from`)
        first = prepare(model, 2**40, batch, blocks=blocks, loss=case.loss, **QUICK)
        profile = first.current.profile
        saved = os.path.join(tmp_path, "adacc_profiles.json")
        with open(saved, "w", encoding="utf-8") as f:
            f.write("[" + ",".join(p.to_json() for p in first.profiles.values()) + "]")
        first.close()
        static = estimate_static_memory(model, optimizer="adamw_torch")
        losses: list[float] = []

        def backward(b: dict) -> float:
            loss = case.step_loss(model, b)
            acc.backward(loss)
            return loss.item()

        for fraction in FRACTIONS:
            budget = budget_between(profile, static, fraction)
            peaks = []
            with DeviceMeter(baseline=live_state_nbytes(model, opt)) as meter:
                for step in range(1, STEPS + 1):
                    b = {k: v.clone() for k, v in batch.items()}  # as a data loader makes it
                    if step == 1:
                        session = prepare(
                            model, budget, b, blocks=blocks, loss=case.loss, profile_from=saved,
                            **QUICK,
                        )  # fmt: skip
                    losses += session.run_step(backward, b)  # out of memory: re-planned
                    del b
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    session.step_done(step)
                    peaks.append(meter.reset_peak())
            predicted = session.policy.metadata["predicted"]["peak_nbytes"]
            session.close()
            print(f"{case.name} {fraction}: budget {budget}, predicted {predicted}, peaks {peaks}")
            assert max(peaks) <= budget, (fraction, peaks, budget)
            for peak in peaks[1:]:  # the first step plans; the others train only
                assert abs(peak - predicted) <= 0.05 * predicted, (fraction, peak, predicted)
    assert losses[-1] < losses[0], losses  # it trains


@pytest.mark.parametrize(
    "name",
    [
        "nanogpt",  # 25-30 s on the shared CPU; the others 40-80 s each
        pytest.param("torchtitan_llama", marks=pytest.mark.slow),
        pytest.param("vit", marks=pytest.mark.slow),
        pytest.param("torchvision_vit", marks=pytest.mark.slow),
    ],
)
def test_an_accelerate_loop_trains_within_three_budgets_and_their_predictions(name, tmp_path):
    accelerate_loop_at_three_budgets(case_of(name), tmp_path)


# ------------------------------------------------------------------ bad input
@pytest.fixture
def no_profiling(monkeypatch):
    """Profiling raises: an error expected before it is the one seen."""

    def refuse(*args, **kwargs):
        raise AssertionError("profiled before the bad input was refused")

    monkeypatch.setattr(profiling, "profile_model", refuse)
    monkeypatch.setattr(profiling, "capture_probes", refuse)


def nanogpt() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return built(CASES["nanogpt"])


def test_a_blocks_pattern_that_matches_nothing_names_what_would(no_profiling):
    model, batch = nanogpt()
    with pytest.raises(UnsupportedModelError, match="matches no module.*'transformer.h.\\*'"):
        prepare(model, "auto", batch, blocks="layers.*")
    with pytest.raises(UnsupportedModelError, match="not a submodule"):
        prepare(model, "auto", batch, blocks=[Block(64, 4)])


def test_blocks_of_one_class_that_differ_in_structure_are_refused(no_profiling):
    model, batch = nanogpt()
    model.transformer.h[2].ln_3 = torch.nn.LayerNorm(64)
    with pytest.raises(
        UnsupportedModelError,
        match="'transformer.h.0' and 'transformer.h.2' are both Block but differ in submodules",
    ):
        prepare(model, "auto", batch, blocks="transformer.h.*")
    model, batch = nanogpt()
    model.transformer.h[1].mlp.c_fc = torch.nn.Linear(64, 128)  # another width
    with pytest.raises(UnsupportedModelError, match="differ in parameter or buffer shapes"):
        prepare(model, "auto", batch, blocks=model.transformer.h)


class Skipping(GPT):
    """A GPT with a spare block its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = torch.nn.ModuleList([Block(64, 4)])


@pytest.mark.parametrize("sample", [True, False], ids=["sample_batch", "first_forward"])
def test_a_block_the_forward_never_calls_is_refused_before_profiling(no_profiling, sample):
    torch.manual_seed(0)
    model = Skipping()
    _, batch = nanogpt()
    blocks = [*model.transformer.h, *model.spare]
    with pytest.raises(UnsupportedModelError, match=r"\['spare.0'\].*never called"):
        session = prepare(model, "auto", batch if sample else None, blocks=blocks)
        model(**batch)  # the first training forward checks, then would plan
    assert not any("forward" in vars(m) for m in blocks)
    if not sample:
        session.close()


def test_a_model_returning_no_loss_is_asked_for_loss_before_profiling(no_profiling):
    torch.manual_seed(0)
    model = Transformer()
    batch = CASES["torchtitan_llama"].batch(torch.Generator().manual_seed(0))
    with pytest.raises(
        UnsupportedModelError, match=r"returns a tensor .*pass prepare\(\.\.\., loss="
    ):
        prepare(model, "auto", {"tokens": batch["tokens"]}, blocks="layers.*")
    with pytest.raises(UnsupportedModelError, match=r"loss= read 'labels'"):
        prepare(
            model,
            "auto",
            {"tokens": batch["tokens"]},
            blocks="layers.*",
            loss=CASES["torchtitan_llama"].loss,
        )


def test_a_block_called_without_its_hidden_states_first_is_refused(no_profiling):
    class Keywords(Transformer):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(x=h, freqs_cis=self.freqs_cis)
            return self.output(self.norm(h))

    torch.manual_seed(0)
    model = Keywords()
    batch = CASES["torchtitan_llama"].batch(torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedModelError, match="block 'layers.0' .*Call it as block\\(x"):
        prepare(model, "auto", batch, blocks="layers.*", loss=CASES["torchtitan_llama"].loss)
