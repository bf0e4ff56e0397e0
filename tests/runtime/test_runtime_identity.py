"""Op identity: every policy op carries a signature (op overload, output dtype, shape class) and
the runtime checks it, region by region, before it keeps anything. A policy traced on a block with
one op more or fewer, or with another op at a key, is detected (a one-time warning, listed in
``handle.problems``) and the ops of the regions it no longer describes are recomputed: no action
ever lands on an op that merely took another op's key."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from conftest import step
from torch import nn

from adacc_hf import Action, apply_adacc, assets, trace_model, uniform_policy
from adacc_hf.runtime.ops import region_of


class SiluTimesOne(nn.Module):
    """SiLU followed by one more op (a multiply by 1): the same values, one op more."""

    def forward(self, x):
        return F.silu(x) * 1.0


def _with_extra_op(model):
    for layer in model.model.layers:
        layer.mlp.act_fn = SiluTimesOne()
    return model


def _retain_all_saved(model, batch):
    policy = uniform_policy(model, "recompute", batch)
    for g in policy.groups.values():
        for op in g.ops:
            if op.saved and op.cacheable:
                g.variants[0].actions[op.key] = Action.retain()
    return policy


def _kept_regions(handle) -> set[str]:
    return {region_of(k) for rt in handle.runtimes.values() for k in rt.last_bytes}


def _run(model, batch, policy, caplog):
    ref_loss, ref_grads, _ = step(model, batch)
    with caplog.at_level(logging.WARNING, "adacc_hf"), apply_adacc(model, policy) as handle:
        loss, grads, _ = step(model, batch)
        loss2, grads2, _ = step(model, batch)
        kept = _kept_regions(handle)
        problems, unknown = handle.problems, handle.unknown_ops
    for got_loss, got in ((loss, grads), (loss2, grads2)):
        assert torch.equal(got_loss, ref_loss)
        assert all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)
    return problems, unknown, kept


def test_a_policy_traced_with_one_op_more_is_detected(caplog):
    traced_on = _with_extra_op(assets.tiny_model("llama"))
    batch = assets.tiny_batch("llama", traced_on)
    policy = _retain_all_saved(traced_on, batch)
    assert any(op.key == "mlp.act_fn/mul#0" for op in policy.groups["block"].ops)
    model = assets.tiny_model("llama")  # the block runs one op fewer
    problems, _, kept = _run(model, batch, policy, caplog)
    assert any("mlp.act_fn" in p for p in problems)
    assert sum("mlp.act_fn" in r.message for r in caplog.records) == 1  # warned once
    assert "mlp.act_fn" not in kept  # nothing kept there: the policy's silu may not be this one
    assert kept  # the regions the policy still describes keep their actions


def test_a_policy_traced_with_one_op_fewer_is_detected(caplog):
    model_plain = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model_plain)
    policy = _retain_all_saved(model_plain, batch)
    model = _with_extra_op(assets.tiny_model("llama"))  # the block runs one op more
    problems, unknown, kept = _run(model, batch, policy, caplog)
    assert any("mlp.act_fn" in p for p in problems)
    assert "mlp.act_fn/mul#0" in unknown
    assert "mlp.act_fn" not in kept and kept


def test_an_extra_op_that_shifts_same_signature_keys_is_detected(caplog):
    """The case keys alone get wrong: the policy's model scales the MLP input first, so its
    ``mlp/mul#0`` is that scaling and ``mlp/mul#1`` the gate product. On the plain model
    ``mlp/mul#0`` is the gate product: same op, dtype and rank, another op. The region's op count
    gives it away; the policy's action for the scaling never reaches the gate product."""
    traced_on = assets.tiny_model("llama")
    for layer in traced_on.model.layers:
        layer.mlp.forward = lambda x, f=layer.mlp.forward: f(x * 1.0)
    batch = assets.tiny_batch("llama", traced_on)
    policy = uniform_policy(traced_on, "recompute", batch)
    gp = policy.groups["block"]
    assert [o.key for o in gp.ops if o.key.startswith("mlp/")] == ["mlp/mul#0", "mlp/mul#1"]
    gp.variants[0].actions["mlp/mul#0"] = Action.retain()  # the scaling, in that model
    gp.variants[0].actions["input_layernorm/mul#1"] = Action.retain()  # an unaffected region
    problems, _, kept = _run(assets.tiny_model("llama"), batch, policy, caplog)
    assert any("'mlp'" in p for p in problems)
    assert "mlp" not in kept and "input_layernorm" in kept


def test_another_op_dtype_or_rank_at_a_key_is_detected(caplog):
    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model)
    base = _retain_all_saved(model, batch)
    gp = base.groups["block"]
    i = next(i for i, o in enumerate(gp.ops) if o.key == "mlp.down_proj/mm#0")
    j = next(i for i, o in enumerate(gp.ops) if o.key == "self_attn.o_proj/mm#0")
    k = next(i for i, o in enumerate(gp.ops) if o.key == "mlp.gate_proj/mm#0")
    gp.ops[i] = dataclasses.replace(gp.ops[i], aten="aten.addmm.default")  # another op
    gp.ops[j] = dataclasses.replace(gp.ops[j], dtype="torch.bfloat16")  # another dtype
    gp.ops[k] = dataclasses.replace(gp.ops[k], shape_class="3")  # another rank
    problems, _, kept = _run(model, batch, base, caplog)
    for region in ("mlp.down_proj", "self_attn.o_proj", "mlp.gate_proj"):
        assert any(f"'{region}'" in p for p in problems), region
        assert region not in kept
    assert "mlp.up_proj" in kept


def test_an_op_sequence_that_changes_under_a_built_table_keeps_nothing_and_rebuilds(caplog):
    """Same call signature, other ops (a module swapped between steps): the fast path sees the
    op at a position differ from the table's and keeps nothing for that forward."""
    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model)
    policy = _retain_all_saved(model, batch)
    ref_loss, ref_grads, _ = step(_with_extra_op(assets.tiny_model("llama")), batch)
    with caplog.at_level(logging.WARNING, "adacc_hf"), apply_adacc(model, policy) as handle:
        step(model, batch)  # tables built for the plain block
        _with_extra_op(model)
        loss, grads, _ = step(model, batch)
        assert all(rt.last_nbytes == 0 for rt in handle.runtimes.values())
        assert any("slot table" in p for p in handle.problems)
        loss2, grads2, _ = step(model, batch)  # rebuilt: only the changed region is dropped
        assert "mlp.act_fn" not in _kept_regions(handle) and _kept_regions(handle)
    for got_loss, got in ((loss, grads), (loss2, grads2)):
        assert torch.equal(got_loss, ref_loss)
        assert all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)


def test_signatures_are_recorded_by_the_trace_and_survive_json():
    from adacc_hf import Policy

    model = assets.tiny_model("llama")
    trace = trace_model(model)
    ops = trace.groups["block"].ops
    assert all(o.aten.startswith("aten.") and o.shape_class for o in ops)
    mm = next(o for o in ops if o.key == "mlp.down_proj/mm#0")
    assert mm.signature == ("aten.mm.default", "torch.float32", "2")
    policy = uniform_policy(model, "compress")
    again = Policy.from_json(policy.to_json())
    assert again.groups["block"].ops == policy.groups["block"].ops


def test_blocks_measured_alone_under_bf16_match_their_policy(caplog):
    """The profiler runs the representative block alone (calibration, action-table transients) on
    its recorded input. Handed in as a leaf that requires grad, that input looked like a parameter
    to the op keys, so BERT's Q/K/V casts of it (they read the block input) got no key and every
    region warned that it ran another op than its policy."""
    from adacc_hf import profile_model

    model = assets.tiny_model("bert", num_hidden_layers=2)
    model.train()
    batch = assets.tiny_batch("bert", model, batch_size=4, seq_len=64, seed=1)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        profile_model(model, batch, repeats=1, autocast=torch.bfloat16)
    assert "adacc: block" not in caplog.text, caplog.text[:600]
