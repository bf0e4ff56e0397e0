"""Compressed activations keep gradients true on the pretrained SmolLM2-135M with real text.

Every figure here is the relative error of all of the model's parameter gradients against the
unpatched step (independent truth: no Adacc code runs in the reference), on the shipped
pretrained weights and Shakespeare (text the model was never tuned on), 4 x 128 tokens, fp32.
Random-init models hide what pretrained attention shows (logits near zero), so these tests use
the real weights. On the code before the consistency rule and FP8 Q / K / V (122aa34), uniform
compress measured 21.3 and Q / K / V alone 18.8 here.
"""

from __future__ import annotations

import copy

import pytest
from conftest import grad_rel_error, smollm2_on_text, step

from adacc_hf import apply_adacc, estimate_static_memory, profile_model, uniform_policy
from adacc_hf.policy.builders import by_layer_type
from adacc_hf.profiler.fidelity import measure_grad_errors, policy_block_error
from adacc_hf.runtime.trace import trace_model
from adacc_hf.solver import MAX_GRAD_ERROR, budget_between, solve

#: The issue's bar for the whole model's gradients under any of these policies.
WHOLE_MODEL_BOUND = 0.3


@pytest.fixture(scope="module")
def smollm2():
    model, batch = smollm2_on_text()
    _, ref, _ = step(model, batch)
    return model, batch, ref


def _whole_error(model, batch, ref, policy) -> float:
    with apply_adacc(model, policy):
        _, grads, _ = step(model, batch)
    return grad_rel_error(grads, ref)


@pytest.mark.slow  # ~2.5 min (the 30-layer model, loaded and run 3 times); make test-all
def test_uniform_compress_and_qkv_alone_keep_gradients_within_the_bar(smollm2):
    model, batch, ref = smollm2
    trace = trace_model(model, batch)
    uniform = uniform_policy(model, "compress", batch)
    qkv = by_layer_type(trace, {"qkv": "compress"})
    errors = {
        n: _whole_error(model, batch, ref, p) for n, p in (("uniform", uniform), ("qkv", qkv))
    }
    assert all(e <= WHOLE_MODEL_BOUND for e in errors.values()), errors


@pytest.mark.slow
def test_every_layer_type_compressed_alone_stays_within_the_bar(smollm2):
    model, batch, ref = smollm2
    trace = trace_model(model, batch)
    types = sorted({o.layer_type for g in trace.groups.values() for o in g.ops})
    errors = {
        t: _whole_error(model, batch, ref, by_layer_type(trace, {t: "compress"})) for t in types
    }
    assert all(e <= WHOLE_MODEL_BOUND for e in errors.values()), errors


@pytest.mark.slow
def test_solved_policies_with_gpu_cheap_codecs_stay_within_the_bound(smollm2):
    """Codec times divided by 10 (as cheap as on a GPU, so compression wins), a budget sweep:
    every policy's measured block gradient error is within ``max_grad_error`` (the solver predicts
    it from single-op errors) and the whole model's within the bar."""
    model, batch, ref = smollm2
    probes: dict = {}
    prof = profile_model(model, batch, repeats=1, probes=probes)
    cheap = copy.deepcopy(prof)
    for g in cheap.groups.values():
        for o in g.ops:
            for cp in o.codecs.values():
                cp.encode_ms, cp.decode_ms = cp.encode_ms / 10, cp.decode_ms / 10
    # as a GPU profile would: the errors of the codecs that can now pay (on the CPU they could not)
    measure_grad_errors(cheap, probes)
    static = estimate_static_memory(model, optimizer="sgd")
    compressed = 0
    for fraction in (0.15, 0.3, 0.6):
        budget = budget_between(cheap, static, fraction)
        policy = solve(cheap, budget, static_nbytes=static, max_grad_error=MAX_GRAD_ERROR).policy
        compressed += sum(
            policy.summary()["block"].get(k, 0)
            for k in policy.summary()["block"]
            if k.startswith("compress")
        )
        assert policy.metadata["predicted"]["grad_error"] <= MAX_GRAD_ERROR + 1e-9
        assert policy_block_error(probes, policy) <= 1.05 * MAX_GRAD_ERROR
        assert _whole_error(model, batch, ref, policy) <= WHOLE_MODEL_BOUND
    assert compressed  # the sweep exercised codecs, not only retain / recompute


@pytest.mark.slow  # ~2 min: aot_eager compiles the 30-layer model three times
def test_compiled_compression_keeps_the_pretrained_gradients_of_eager_compression(smollm2):
    """Under ``torch.compile`` (aot_eager) with every op compressed, the pretrained model's
    gradients are eager compression's within 1e-5. Not bit for bit here: compiling alone moves
    this model's gradients by 6.2e-7 (the unpatched model compiled against eager, and so does a
    retain / recompute policy; on the tiny models both are exact). Compressed, the compiled step
    is 6.5e-7 from eager's, its error against the unpatched model the same 0.2528."""
    import torch

    model, batch, ref = smollm2

    def compiled_grads() -> dict:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        torch.compile(model, backend="aot_eager")(**batch).loss.backward()
        torch._dynamo.reset()
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    torch._dynamo.reset()
    floor = grad_rel_error(compiled_grads(), ref)  # what compiling alone moves
    policy = uniform_policy(model, "compress", batch)
    policy.metadata["compile"] = "aot_eager"  # as `prepare(..., compile="aot_eager")` marks it
    with apply_adacc(model, policy):
        _, eager, _ = step(model, batch)
        got = compiled_grads()
    assert floor < 1e-5
    assert grad_rel_error(got, eager) <= 1e-5
    assert abs(grad_rel_error(got, ref) - grad_rel_error(eager, ref)) <= 1e-5
    assert 0 < grad_rel_error(got, ref) <= WHOLE_MODEL_BOUND
