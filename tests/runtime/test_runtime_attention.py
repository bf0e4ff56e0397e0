"""Attention outputs are policy ops on every SDPA backend: they can be retained (bitwise-equal
gradients) or compressed (output and log-sum-exp), and attention dropout is replayed from its
RNG state instead of being excluded. CPU backends here: the CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, random-tagged), the math path (decomposed,
with CPU dropout's in-place RNG fill), and a flash-like custom op that, like CUDA flash / cuDNN
attention, returns an int beside its tensors and draws its dropout mask from the generator."""

from __future__ import annotations

import pytest
import torch
from conftest import step
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from adacc_hf import Action, apply_adacc, assets, trace_model, uniform_policy
from adacc_hf.runtime.ops import KEYED, draws_random, is_random, op_kind

aten = torch.ops.aten


def test_every_sdpa_variant_is_a_keyed_op_the_runtime_can_keep():
    variants = [
        aten._scaled_dot_product_flash_attention.default,  # returns SymInts (CUDA)
        aten._scaled_dot_product_cudnn_attention.default,  # returns SymInts (CUDA)
        aten._scaled_dot_product_efficient_attention.default,  # random-tagged (CUDA)
        aten._scaled_dot_product_flash_attention_for_cpu.default,  # random-tagged (CPU)
        aten.native_dropout.default,
    ]
    for op in variants:
        assert op_kind(op) == KEYED, op
        assert is_random(op), op


def test_a_random_tagged_attention_call_without_dropout_draws_nothing():
    """Tagged random for its dropout, attention called with ``dropout_p=0`` draws nothing: its
    kept output holds no generator state and a compiled block saves it as planned
    (`runtime.compiled`); with dropout, or an op without the argument, the tag decides."""
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 8, 4)
    assert not draws_random(flash, (q, q, q), {})  # the schema's default, 0
    assert not draws_random(flash, (q, q, q, 0.0), {})
    assert draws_random(flash, (q, q, q, 0.1), {})
    assert draws_random(flash, (q, q, q), {"dropout_p": 0.1})
    assert draws_random(aten.native_dropout.default, (q, 0.0, True), {})
    assert not draws_random(aten.mm.default, (q, q), {})
    model, batch = _llama(0.0)  # (the CPU flash kernel has no dropout: math path then)
    ops = trace_model(model, batch).groups["block"].ops
    (op,) = [o for o in ops if "flash_attention_for_cpu" in o.key]
    assert op.rng_states == 0


def _llama(dropout: float):
    model = assets.tiny_model("llama", attention_dropout=dropout)
    return model, assets.tiny_batch("llama", model)


def _keep(policy, pred, action=None):
    keys = []
    for g in policy.groups.values():
        for op in g.ops:
            if pred(op):
                g.variants[0].actions[op.key] = action or Action.retain()
                keys.append(op.key)
    assert keys
    return keys


@pytest.mark.parametrize(
    ("backend", "dropout", "kept"),
    [
        (SDPBackend.FLASH_ATTENTION, 0.0, "_scaled_dot_product_flash_attention_for_cpu"),
        (SDPBackend.MATH, 0.0, "bmm#1"),  # the math path's context matmul
        (SDPBackend.MATH, 0.3, "bmm#1"),  # ... and with attention dropout
    ],
)
def test_retained_attention_gives_bitwise_equal_gradients(backend, dropout, kept):
    model, batch = _llama(dropout)
    with sdpa_kernel(backend):
        ref_loss, ref_grads, _ = step(model, batch)
        policy = uniform_policy(model, "recompute", batch)
        keys = _keep(policy, lambda op: op.key.startswith("self_attn/") and kept in op.key)
        if dropout:  # keep the dropout mask too (bit-packed): replay must skip its RNG fill
            keys += _keep(policy, lambda op: op.mask, Action.compress("bitpack"))
        with apply_adacc(model, policy) as handle:
            loss, grads, _ = step(model, batch)
            step(model, batch)
            loss2, grads2, _ = step(model, batch)  # slot tables built: the fast path
            kept_bytes = [rt.last_bytes for rt in handle.runtimes.values()]
    assert not handle.problems
    assert all(set(keys) <= set(b) for b in kept_bytes)  # really kept, in every block
    for got_loss, got in ((loss, grads), (loss2, grads2)):
        assert torch.equal(got_loss, ref_loss)
        assert all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)


def test_the_cpu_flash_output_and_logsumexp_are_one_op_retained_and_never_compressed():
    """Retained, the fused op keeps its output and log-sum-exp together (gradients exact); asked
    to compress it, the policy is repaired to recompute it (its backward would rebuild the
    probabilities from an exact lse beside a lossy output: `policy.consistency`)."""
    model, batch = _llama(0.0)
    trace = trace_model(model, batch)
    op = next(o for o in trace.groups["block"].ops if "flash_attention_for_cpu" in o.key)
    assert op.layer_type == "attn_fused" and op.cacheable and op.shape_class == "4,3"
    _, ref_grads, ref_out = step(model, batch)
    retained = uniform_policy(model, "recompute", batch)
    _keep(retained, lambda o: o.key == op.key, Action.retain())
    with apply_adacc(model, retained) as handle:
        step(model, batch)
        _, grads, out = step(model, batch)
        rt = next(iter(handle.runtimes.values()))
        assert rt.last_bytes[op.key] == op.nbytes  # output and log-sum-exp
    assert torch.equal(out.logits, ref_out.logits)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    lossy = uniform_policy(model, "recompute", batch)
    _keep(lossy, lambda o: o.key == op.key, Action.compress("int4_channel"))
    with pytest.warns(UserWarning, match="lossy input"), apply_adacc(model, lossy):
        _, grads, _ = step(model, batch)
    assert all(v.action(op.key).kind == "recompute" for v in lossy.groups["block"].variants)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


# -- a flash-like op: ints beside its tensors, dropout drawn from the generator ----------------


@torch.library.custom_op(
    "adacc_test::flashlike", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def flashlike(q: Tensor, k: Tensor, v: Tensor, p: float) -> tuple[Tensor, Tensor, int, Tensor]:
    """Causal attention with dropout; returns (out, logsumexp, max_seqlen, rng_state) the way
    CUDA flash attention does (the generator state the backward regenerates the mask from)."""
    state = torch.get_rng_state()
    out, lse = _flashlike_math(q, k, v, p, torch.rand((*q.shape[:-1], k.shape[-2])))
    return out, lse, q.shape[-2], state


def _flashlike_math(q, k, v, p, u):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse.unsqueeze(-1))
    keep = (u >= p).to(probs.dtype) / (1 - p) if p > 0 else torch.ones_like(probs)
    return (probs * keep) @ v, lse


@flashlike.register_fake
def _(q, k, v, p):
    n = torch.library.get_ctx().new_dynamic_size()
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1]), n, torch.empty(5056, dtype=torch.uint8)


def _flashlike_setup(ctx, inputs, output):
    q, k, v, p = inputs
    ctx.p = p
    ctx.save_for_backward(q, k, v, output[3])


def _flashlike_backward(ctx, g_out, g_lse, g_n, g_state):
    q, k, v, state = ctx.saved_tensors
    gen = torch.Generator().set_state(state)  # the mask forward drew
    u = torch.rand((*q.shape[:-1], k.shape[-2]), generator=gen)
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = _flashlike_math(*qkv, ctx.p, u)
        grads = torch.autograd.grad(out, qkv, g_out)
    return (*grads, None)


flashlike.register_autograd(_flashlike_backward, setup_context=_flashlike_setup)


def _flashlike_attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    out, _, _, _ = torch.ops.adacc_test.flashlike(query, key, value, dropout)
    return out.transpose(1, 2).contiguous(), None


def test_a_flash_like_op_with_int_outputs_and_dropout_is_kept_and_its_rng_replayed():
    """GPT-2 has a residual dropout after attention: if replay did not restore the generator
    after handing back the kept attention, that dropout would draw another mask in recompute and
    the gradients would differ."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("adacc_testattn", _flashlike_attention)
    AttentionMaskInterface.register("adacc_testattn", sdpa_mask)
    model = assets.tiny_model("gpt2", attn_pdrop=0.3)
    model.set_attn_implementation("adacc_testattn")
    batch = assets.tiny_batch("gpt2", model)
    ref_loss, ref_grads, _ = step(model, batch)
    torch.manual_seed(1)
    other_loss = model(**batch).loss
    assert not torch.equal(other_loss, ref_loss)  # dropout is on: RNG replay matters
    policy = uniform_policy(model, "recompute", batch)
    keys = _keep(policy, lambda op: "flashlike" in op.key)
    assert all(
        op.cacheable and op.shape_class == "4,3,1"
        for g in policy.groups.values()
        for op in g.ops
        if op.key in keys
    )
    with apply_adacc(model, policy) as handle:
        step(model, batch)
        loss, grads, _ = step(model, batch)
        assert all(set(keys) <= set(rt.last_bytes) for rt in handle.runtimes.values())
    assert not handle.problems
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
