"""apply_adacc patches one instance reversibly; applying twice is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_policy, step

from adacc_hf import (
    AdaccError,
    AlreadyAppliedError,
    UnsupportedModelError,
    apply_adacc,
    assets,
    attention_recompute_policy,
    uniform_policy,
)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_remove_restores_the_model_exactly(tiny):
    model, batch = tiny
    pristine = copy.deepcopy(model)
    before_dicts = {n: set(vars(m)) for n, m in model.named_modules()}
    policy = random_policy(model, batch, seed=2, kinds=("retain", "recompute", "compress"))
    handle = apply_adacc(model, policy)
    assert handle.runtimes and all(
        "_gradient_checkpointing_func" in vars(rt.block) for rt in handle.runtimes.values()
    )
    step(model, batch)
    assert _hooks(model) == 0  # region hooks live only while a block builds its slot table
    handle.remove()

    assert _hooks(model) == 0
    assert {n: set(vars(m)) for n, m in model.named_modules()} == before_dicts
    assert str(model) == str(pristine)
    sd, ref_sd = model.state_dict(), pristine.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    loss, grads, out = step(model, batch)
    ref_loss, ref_grads, ref_out = step(pristine, batch)
    assert torch.equal(loss, ref_loss) and torch.equal(out.logits, ref_out.logits)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    handle.remove()  # a second remove is a no-op


def test_context_manager_form_removes_on_exit(tiny):
    model, batch = tiny
    with apply_adacc(model, uniform_policy(model, "recompute", batch)) as handle:
        assert handle.active and handle.runtimes
    assert not handle.active and _hooks(model) == 0
    assert all("_gradient_checkpointing_func" not in vars(m) for m in model.modules())


def test_applying_twice_is_a_clear_error_and_reapply_after_remove_works(tiny):
    model, batch = tiny
    policy = uniform_policy(model, "recompute", batch)
    handle = apply_adacc(model, policy)
    with pytest.raises(AlreadyAppliedError, match="already applied"):
        apply_adacc(model, policy)
    handle.remove()
    with apply_adacc(model, policy):
        pass


def test_set_policy_switches_without_double_patching(tiny):
    model, batch = tiny
    ref_loss, ref_grads, _ = step(model, batch)
    handle = apply_adacc(model, uniform_policy(model, "recompute", batch))
    hooks = _hooks(model)
    handle.set_policy(attention_recompute_policy(model, batch))
    assert _hooks(model) == hooks
    loss, grads, _ = step(model, batch)
    handle.remove()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_hf_gradient_checkpointing_already_on_is_refused(tiny):
    model, batch = tiny
    policy = uniform_policy(model, "recompute", batch)
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(AdaccError, match="checkpointing_disable"):
        apply_adacc(model, policy)
    (disable or model.gradient_checkpointing_disable)()
    apply_adacc(model, policy).remove()


def test_a_model_compiled_before_adacc_is_patched_through_its_wrapper(tiny):
    """``torch.compile(model)`` first, adacc second: the wrapper's model is patched, and the
    compiled forward traces the policy (tests/runtime/test_compile.py checks what it runs); a
    compressing policy is refused when traced, and the uncompiled model still trains."""
    model, batch = tiny
    compiled = torch.compile(model, backend="aot_eager")
    handle = apply_adacc(compiled, uniform_policy(model, "recompute", batch))
    assert handle.model is model and handle.runtimes
    compiled(**batch).loss.backward()
    handle.remove()
    torch._dynamo.reset()
    with apply_adacc(model, uniform_policy(model, "compress", batch)):
        with pytest.raises(AdaccError, match="torch.compile"):
            torch.compile(model, backend="aot_eager")(**batch)
        step(model, batch)
    torch._dynamo.reset()


def test_unsupported_model_names_the_supported_families():
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=16,
        )
    )
    assert uniform_policy(opt, "recompute").groups  # the generic adapter runs it
    opt.model.decoder.layers = torch.nn.ModuleList([torch.nn.Identity()])  # no checkpointable block
    with pytest.raises(UnsupportedModelError, match="GradientCheckpointingLayer.*bert, bloom"):
        uniform_policy(opt, "recompute")
    with pytest.raises(UnsupportedModelError, match="no `config.model_type`"):
        uniform_policy(torch.nn.Linear(2, 2), "recompute")


def test_policy_for_another_model_is_refused_before_patching():
    llama = assets.tiny_model("llama")
    gpt2 = assets.tiny_model("gpt2")
    deeper = assets.tiny_model("llama", num_hidden_layers=3)
    policy = uniform_policy(llama, "recompute")
    from adacc_hf import PolicyError

    with pytest.raises(PolicyError, match="made for a 'llama' model, not 'gpt2'"):
        apply_adacc(gpt2, policy)
    with pytest.raises(PolicyError, match="do not match"):
        apply_adacc(deeper, policy)
    assert _hooks(gpt2) == 0 and _hooks(deeper) == 0


def _live_storages() -> dict[int, int]:
    import gc

    gc.collect()
    out = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.device.type != "meta":
            s = o.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def test_planning_and_training_leave_nothing_alive_but_the_optimizer_states():
    """`prepare` profiles (tracing a block, aborting the forward), solves and measures action
    tables; afterwards no tensor of any of it may stay alive. A traced block once kept its whole
    forward graph (a cycle through C++ no collector frees): on a GPU, hundreds of MiB per
    profiled bucket outside every prediction."""
    from adacc_hf import estimate_static_memory, prepare, profile_model
    from adacc_hf.solver import budget_between

    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4, vocab_size=512)
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = budget_between(
        profile_model(model, batch, repeats=1), estimate_static_memory(model), 0.3
    )
    before = _live_storages()
    session = prepare(model, budget, batch, optimizer="adamw_torch", adaptive=True)
    assert set(_live_storages()) <= set(before)  # the profile, the traces: all gone
    for i in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        session.step_done(i + 1)
    states = {
        t.untyped_storage().data_ptr()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    }
    assert set(_live_storages()) - set(before) <= states
    session.close()
