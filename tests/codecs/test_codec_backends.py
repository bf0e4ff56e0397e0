"""Codec backends: every implementation gives the reference's bits, a pinned backend that cannot
run falls back out loud, and the fastest backend measured is the one a policy names and runs.

The truth here is the torch reference (``Codec._encode`` / ``_decode``), run eagerly; the Triton
kernels are held to it in `test_kernels.py` (under the interpreter, through their autotuners).
"""

from __future__ import annotations

import logging

import pytest
import torch

from adacc_hf import apply_adacc, uniform_policy
from adacc_hf.codecs import CodecError, available_codecs, backends, get_codec
from adacc_hf.codecs.backends import same_bits
from adacc_hf.errors import PolicyError
from adacc_hf.profiler.ops import profile_codec
from adacc_hf.schema import Action, Variant
from adacc_hf.testing.tiny import tiny_batch, tiny_model

SHAPES = [(3, 37), (64, 576), (2, 5, 130), (1, 8), (4, 256)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _input(name: str, shape, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "bitpack":
        return (torch.rand(shape, generator=g) > 0.3).to(dtype) * 1.25
    x = torch.randn(shape, generator=g) * 3
    x.view(-1)[:: max(1, shape[-1] // 5)] *= 40  # hot channels, as pretrained activations have
    x.view(-1)[1] = float("inf")  # a flagged segment
    x.view(-1)[-1] = float("nan")
    return x.to(dtype)


def _payloads_equal(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        same_bits(a.tensors[k], b.tensors[k]) for k in a.tensors
    )


def _inductor_matches_the_reference(name: str, cases) -> None:
    """Payload and decoded tensor bit for bit in every case; every graph compiled (none refused
    by the check against the reference)."""
    backends.clear_compiled()
    ref, ind = get_codec(name, backend="torch"), get_codec(name, backend="inductor")
    for shape, dtype in cases:
        x = _input(name, shape, dtype)
        want, got = ref.encode(x), ind.encode(x)
        assert _payloads_equal(want, got), (shape, dtype)
        assert same_bits(ind.decode(want), ref.decode(want)), (shape, dtype)
    assert backends.compiled_counts() == (2 * len(cases), 0)


@pytest.mark.parametrize("name", sorted(available_codecs()))
def test_the_inductor_backend_gives_the_references_bits(name):
    """A padded 3-D fp32 input and a wide bf16 one, both with non-finite values (the whole
    matrix of shapes and dtypes is the slow test below)."""
    _inductor_matches_the_reference(
        name, [((2, 5, 130), torch.float32), ((64, 576), torch.bfloat16)]
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(available_codecs()))
def test_the_inductor_backend_gives_the_references_bits_on_every_shape_and_dtype(name):
    _inductor_matches_the_reference(name, [(s, d) for s in SHAPES for d in DTYPES])


def test_inductor_encodes_a_permuted_dense_input_in_its_memory_order():
    x = _input("int4_channel", (6, 10, 64), torch.bfloat16).transpose(0, 1).contiguous()
    x = x.transpose(0, 1)  # dense, leading dims permuted in memory
    ref, ind = get_codec("int4_channel", backend="torch"), get_codec("int4_channel", "inductor")
    want, got = ref.encode(x), ind.encode(x)
    assert got.order == want.order is not None and _payloads_equal(want, got)
    out = ind.decode(got)
    assert out.stride() == x.stride() and same_bits(out, ref.decode(want))


def test_a_compiled_graph_unlike_the_reference_is_refused(monkeypatch, caplog):
    """The check that guards against compiler bugs: a compiled encode that returns other bits is
    never used (the reference runs, a warning says so)."""
    real = backends._compile

    def wrong(fn, inputs):
        compiled = real(fn, inputs)
        return lambda *a: [t + 1 if t.is_floating_point() else t for t in compiled(*a)]

    monkeypatch.setattr(backends, "_compile", wrong)
    backends.clear_compiled()
    x = _input("int4_asym", (8, 64), torch.float32)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        got = get_codec("int4_asym", backend="inductor").encode(x)
    assert _payloads_equal(got, get_codec("int4_asym").encode(x))
    assert backends.compiled_counts() == (0, 1)
    assert "differs from the reference" in caplog.text
    backends.clear_compiled()


def test_a_pinned_backend_that_cannot_run_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    codec = get_codec("int4_naive", backend="triton")
    x = _input("int4_naive", (4, 64), torch.float32)
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        first = codec.encode(x)
        codec.encode(x)
    lines = [r for r in caplog.records if "triton backend cannot run" in r.getMessage()]
    assert len(lines) == 1 and "using torch" in lines[0].getMessage()
    assert _payloads_equal(first, get_codec("int4_naive", backend="torch").encode(x))


def test_an_explicit_kernel_mode_overrides_a_pinned_backend():
    from adacc_hf.codecs import kernel_mode_override

    codec = get_codec("int4_asym", backend="inductor")
    with kernel_mode_override("torch"):
        assert backends.resolve(codec, torch.device("cpu")) == "torch"
    assert backends.resolve(codec, torch.device("cpu")) == "inductor"


def test_a_backend_a_codec_does_not_have_is_refused_by_name():
    with pytest.raises(CodecError, match="has no backend 'bitsandbytes'"):
        get_codec("int4_outlier", backend="bitsandbytes")
    assert "triton" in backends.backends_of("int4_outlier")


def test_actions_and_policies_name_their_backend():
    a = Action.compress("int4_outlier", backend="inductor", group_size=64)
    assert a.to_json() == {
        "compress": "int4_outlier",
        "params": {"group_size": 64},
        "backend": "inductor",
    }
    assert Action.from_json(a.to_json()) == a
    assert Action.from_json({"compress": "int4_outlier", "params": {}}).backend is None
    assert str(a) == "compress:int4_outlier(group_size=64)@inductor"
    assert a != Action.compress("int4_outlier", group_size=64)
    with pytest.raises(PolicyError, match="without a codec takes no backend"):
        Action("retain", backend="torch")


def test_a_policy_naming_an_unknown_backend_is_refused_on_load(tmp_path):
    model = tiny_model("llama")
    batch = tiny_batch("llama", model)
    policy = uniform_policy(model, "compress", batch)
    g = next(iter(policy.groups.values()))
    key = next(k for k, a in g.variants[0].actions.items() if a.kind == "compress")
    g.variants[0].actions[key] = Action("compress", "int4_outlier", (), "nonesuch")
    with pytest.raises(PolicyError, match="no backend 'nonesuch'"):
        policy.check()


def test_profiling_times_each_backend_and_keeps_the_fastest():
    x = _input("int4_outlier", (256, 576), torch.float32)[..., :].nan_to_num(0.0, 0.0, 0.0)
    cp = profile_codec(
        get_codec("int4_outlier"), x, torch.device("cpu"), backends_allowed=["torch", "inductor"]
    )
    assert set(cp.backend_ms) == {"torch", "inductor"}
    assert cp.backend == min(cp.backend_ms, key=lambda b: sum(cp.backend_ms[b]))
    assert [cp.encode_ms, cp.decode_ms] == cp.backend_ms[cp.backend]
    assert cp.action().backend == cp.backend
    only = profile_codec(get_codec("int4_outlier"), x, torch.device("cpu"))
    assert only.backend == "" and only.backend_ms == {}  # one backend measured: no choice made


def test_a_policy_run_on_the_inductor_backend_trains_as_the_reference_does():
    """Gradients bit for bit: a compress policy whose actions name inductor against the same
    policy on the reference."""
    model = tiny_model("llama")
    batch = tiny_batch("llama", model)
    policy = uniform_policy(model, "compress", batch)

    def grads(p):
        model.zero_grad(set_to_none=True)
        with apply_adacc(model, p):
            torch.manual_seed(0)
            model(**batch).loss.backward()
        return [q.grad.clone() for q in model.parameters() if q.grad is not None]

    pinned = uniform_policy(model, "compress", batch)
    for g in pinned.groups.values():
        g.variants = [
            Variant(
                v.count,
                v.checkpoint,
                {
                    k: Action(a.kind, a.codec, a.params, "inductor") if a.codec else a
                    for k, a in v.actions.items()
                },
                v.offload_input,
            )
            for v in g.variants
        ]
    backends.clear_compiled()
    want, got = grads(policy), grads(pinned)
    assert backends.compiled_counts()[0] > 0
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
