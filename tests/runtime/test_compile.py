"""Adacc under torch.compile: a policy's retain / recompute decisions as selective-checkpoint tags,
its compressed ops encoded and decoded inside the compiled graphs (`runtime.saved_codecs`).

Truth: the same policy run eagerly (itself checked against the unpatched model elsewhere). With
``aot_eager`` the compiled step runs the very aten ops of the trace, so gradients are equal bit for
bit; inductor fuses pointwise ops and reorders fp32 sums, so there each parameter's gradient is
held to 1e-5 of its largest entry (seen: 5e-7). Dropout is off (attention dropout 0): a compiled
graph draws its own random numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import adacc_hf.runtime.compiled as compiled
from adacc_hf import (
    apply_adacc,
    assets,
    attention_recompute_policy,
    measure_step_peak,
    prepare,
    uniform_policy,
)
from adacc_hf.engine.config import AdaccConfig
from adacc_hf.errors import AdaccError
from adacc_hf.schema import Action, Variant
from adacc_hf.solver.step import extreme_peaks

RECOMPUTE = Action.recompute()


def _model(family: str, model=None):
    model = assets.tiny_model(family) if model is None else model
    for m in model.modules():
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    return model, assets.tiny_batch(family, model, batch_size=2, seq_len=16)


def _grads(call, model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    call(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = (got[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        assert err <= tol, f"{name}: {err:.2e}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    compiled.RECORD = None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compiled_adacc_gives_eager_adaccs_gradients_and_saves_what_the_policy_retains(family):
    model, batch = _model(family)
    policy = attention_recompute_policy(model, batch)  # checkpointed blocks that retain ops
    handle = apply_adacc(model, policy)
    eager = _grads(model, model, batch)
    compiled.RECORD = []
    got = _grads(torch.compile(model, backend="aot_eager"), model, batch)
    _assert_close(got, eager, 0.0)
    rt = next(iter(handle.runtimes.values()))  # the tiny models' blocks are alike
    retained = [
        s.aten
        for s in rt.specs
        if rt.actions.get(s.key, RECOMPUTE).kind == "retain" and not s.rng_states
    ]
    assert retained, "the policy retains nothing: nothing to tag"
    assert compiled.RECORD, "no block was traced with selective-checkpoint tags"
    for aligner in compiled.RECORD:  # every traced pass of every block
        assert aligner.pos == len(aligner.wanted)  # walked the policy to its end
        assert aligner.saved == retained  # tagged MUST_SAVE: exactly the retained ops
    handle.remove()


def test_retained_attention_is_saved_by_the_compiled_graph():
    """The CPU flash kernel is tagged random (for its dropout); called with ``dropout_p=0`` it
    draws nothing, so a retained attention output is tagged ``MUST_SAVE`` as planned. It was left
    to the partitioner, which recomputed it: the plan's retain silently dropped (llama-cpu: 3 of a
    compiled block's 10 ms of recomputation)."""
    model, batch = _model("llama")
    policy = uniform_policy(model, "recompute", batch)
    kept = []
    for g in policy.groups.values():
        for op in g.ops:
            if "flash_attention_for_cpu" in op.aten:
                g.variants[0].actions[op.key] = Action.retain()
                kept.append(op.aten)
    assert kept and all(op.rng_states == 0 for g in policy.groups.values() for op in g.ops)
    handle = apply_adacc(model, policy)
    eager = _grads(model, model, batch)
    compiled.RECORD = []
    got = _grads(torch.compile(model, backend="aot_eager"), model, batch)
    _assert_close(got, eager, 0.0)
    assert compiled.RECORD
    assert all(a.saved == kept[:1] for a in compiled.RECORD)
    handle.remove()


@pytest.mark.slow  # ~30 s: an inductor compile on the shared CPU
def test_inductor_gradients_equal_eager_adaccs_within_fp32_reassociation():
    model, batch = _model("llama")
    handle = apply_adacc(model, attention_recompute_policy(model, batch))
    eager = _grads(model, model, batch)
    got = _grads(torch.compile(model), model, batch)
    _assert_close(got, eager, 1e-5)
    handle.remove()


def test_a_new_policy_recompiles_and_trains_with_its_own_tags():
    model, batch = _model("llama")
    attn = attention_recompute_policy(model, batch)
    handle = apply_adacc(model, attn)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model, backend=counter)
    _grads(step, model, batch)
    frames = counter.frame_count
    handle.set_policy(uniform_policy(model, "recompute", batch))
    full = _grads(model, model, batch)
    assert counter.frame_count == frames  # eager call: nothing compiled
    _assert_close(_grads(step, model, batch), full, 0.0)
    assert counter.frame_count > frames  # the variant's guard failed: traced again
    handle.remove()


def _compressing(model, batch, backend: str | None, output: bool = False):
    """Every op of every block compressed with its layer type's codec; planned for `backend`.
    `output`: the block's last op (its output, recomputed by the uniform policy) too."""
    policy = uniform_policy(model, "compress", batch)
    if backend:
        policy.metadata["compile"] = backend
    for gp in policy.groups.values() if output else ():
        for v in gp.variants:
            v.actions[gp.ops[-1].key] = Action.compress("int4_outlier")
    return policy


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_compiled_compression_gives_eager_adaccs_gradients_bit_for_bit(family):
    """Each compressed op's output is encoded in the compiled forward and decoded in the
    compiled backward by the same codec on the same tensor: with aot_eager (the trace's own aten
    ops) the gradients equal eager Adacc's bit for bit, and both are off the unpatched model's by
    the codecs' error (so compression ran). The block's output, compressed too, is saved whole
    under compile (decoded, it fed the next block's recompute: 0.146 off eager before)."""
    model, batch = _model(family)
    exact = _grads(model, model, batch)
    handle = apply_adacc(model, _compressing(model, batch, "aot_eager", output=True))
    eager = _grads(model, model, batch)
    got = _grads(torch.compile(model, backend="aot_eager"), model, batch)
    _assert_close(got, eager, 0.0)
    with pytest.raises(AssertionError):
        _assert_close(got, exact, 1e-3)
    handle.remove()


@pytest.mark.slow  # ~30 s: an inductor compile on the shared CPU
def test_inductor_compression_errs_as_much_as_eager_codecs():
    """Inductor fuses the ops that make a codec's input, so a few of its values move in the last
    float32 bit and some INT4 codes round the other way: gradients are not eager's bit for bit,
    but their error against the unpatched model is eager's within 10 % (seen: 1.5 %)."""
    model, batch = _model("llama")
    exact = _grads(model, model, batch)
    handle = apply_adacc(model, _compressing(model, batch, "inductor"))
    eager = _grads(model, model, batch)
    got = _grads(torch.compile(model), model, batch)
    handle.remove()

    def error(grads: dict) -> float:
        return max(float((grads[n] - r).abs().max() / r.abs().max()) for n, r in exact.items())

    assert 0.9 * error(eager) <= error(got) <= 1.1 * error(eager), (error(got), error(eager))


def test_compiled_compression_holds_no_more_than_eager_compression():
    """Torch inlines the codec hooks at the forward's end and the backward's start; placed there,
    every raw tensor lives to the end of the forward and every decoded one through the whole
    backward (tiny llama 4 x 64: 4.58 MiB, above retaining everything's 3.37). `saved_codecs`
    moves each encode next to its input and each decode next to its first use: the compiled
    step, measured by the allocator, holds at most eager compression's peak (seen: 2.81 against
    3.02 MiB)."""
    model, _ = _model("llama")
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = apply_adacc(model, _compressing(model, batch, "aot_eager"))
    eager = measure_step_peak(model, batch, opt).peak_nbytes
    step = torch.compile(model, backend="aot_eager")
    step(**batch).loss.backward()
    opt.zero_grad(set_to_none=True)
    compiled_peak = measure_step_peak(step, batch, opt).peak_nbytes
    handle.remove()
    assert compiled_peak <= eager, (compiled_peak, eager)


def test_compression_planned_eagerly_and_offload_are_refused_when_traced_naming_the_op():
    """A compressing policy planned without ``compile=`` has no codec hooks installed (its ops
    would be saved whole, over the plan); offload has no compiled form."""
    model, batch = _model("llama")
    handle = apply_adacc(model, _compressing(model, batch, None))
    step = torch.compile(model, backend="aot_eager")
    with pytest.raises(AdaccError, match=r"op .* is planned as compress:.*compile=<backend>"):
        step(**batch)
    handle.remove()
    torch._dynamo.reset()
    policy = uniform_policy(model, "offload", batch)
    policy.metadata["compile"] = "aot_eager"
    handle = apply_adacc(model, policy)
    with pytest.raises(AdaccError, match=r"block .* offloads.*offload=False"):
        step(**batch)
    handle.remove()
    _grads(step, model, batch)  # unpatched: compiles and trains


@pytest.mark.slow  # ~40 s: two sessions profile the tiny llama
def test_a_session_plans_each_new_bucket_eagerly_and_its_compiled_steps_train():
    """`prepare` then `torch.compile`: the session's hook runs outside the compiled graph, so a
    new batch shape is profiled and planned eagerly (inside the compiled model's call), and the
    compiled step runs its plan: the gradients of eager and compiled calls are equal. Going back
    to a bucket planned before recompiles nothing (recompiles are bounded by the buckets)."""
    model, batch = _model("llama")
    kw = dict(optimizer="sgd", adaptive=False, codecs=[], offload=False, profile_repeats=1)
    session = prepare(model, "100GiB", batch, **kw)
    lo, hi = extreme_peaks(session.profile, session.ctx.static_memory(), 1, "full")
    session.close()
    session = prepare(model, (lo.peak_nbytes + hi.peak_nbytes) // 2, batch, **kw)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model, backend=counter)
    _assert_close(_grads(step, model, batch), _grads(model, model, batch), 0.0)
    longer = assets.tiny_batch("llama", model, batch_size=2, seq_len=24)
    plans = len(session.plans)
    compiled_grads = _grads(step, model, longer)  # planned in the hook, then traced
    assert len(session.plans) == plans + 1
    _assert_close(compiled_grads, _grads(model, model, longer), 0.0)
    frames = counter.frame_count
    for b in (batch, longer, batch, longer):  # back and forth: each bucket's graph is cached
        _grads(step, model, b)
    assert counter.frame_count == frames, "a bucket seen before was compiled again"
    session.close()


def _planned(
    family: str, fraction: float, backend: str, compile_profile: bool = True, profiles=None
):
    """A session planned at `fraction` of the way between the least step peak and no
    checkpointing's (both from a compile profile), then the model compiled whole with `backend`:
    (budget, predicted peak, measured peak of a compiled training step with SGD, whether the
    plan keeps any op). `profiles` (a list) gets the session's profile."""
    model, batch = _model(family)
    batch = assets.tiny_batch(family, model, batch_size=4, seq_len=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kw = dict(optimizer=opt, adaptive=False, codecs=[], offload=False, profile_repeats=1)
    if compile_profile:
        kw["compile"] = backend
    probe = prepare(model, "100GiB", batch, **{**kw, "compile": backend})
    assert probe.profile.compiled["backend"] == backend
    lo, hi = extreme_peaks(probe.profile, probe.ctx.static_memory(), 1, "full")
    probe.close()
    budget = int(lo.peak_nbytes + fraction * (hi.peak_nbytes - lo.peak_nbytes))
    session = prepare(model, budget, batch, **kw)
    policy = session.handle.policy
    predicted = policy.metadata["predicted"]["peak_nbytes"]
    keeps = any(v.actions for g in policy.groups.values() for v in g.variants if v.count)
    step = torch.compile(model, backend=backend)
    step(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    measured = measure_step_peak(step, batch, opt).peak_nbytes
    if profiles is not None:
        profiles.append(session.profile)
    session.close()
    return budget, predicted, measured, keeps


@pytest.mark.parametrize(
    "family,fraction",
    [
        ("llama", 0.0),
        pytest.param("llama", 0.5, marks=pytest.mark.slow),  # ~20 s each on the shared CPU
        pytest.param("llama", 1.0, marks=pytest.mark.slow),
        pytest.param("gpt2", 0.5, marks=pytest.mark.slow),
    ],
)
def test_a_compile_planned_step_fits_its_budget_and_its_prediction(family, fraction):
    """`prepare(..., compile=backend)` profiles the blocks, the head and the whole step compiled
    (`profiler.compiled`): the compiled step, measured by the allocator, is within the budget
    and at most 5 % above the plan's prediction (aot_eager: AOTAutograd's partition, no
    fusion); within 5 % both ways where the plan keeps no op. A kept op's action table is
    measured compiled only where its run alone fits the room left (not on these tiny budgets):
    unmeasured, the step model counts its kept outputs beside full recomputation's transient
    (8-30 % over here, the budget's safe side)."""
    budget, predicted, measured, keeps = _planned(family, fraction, "aot_eager")
    assert measured <= budget, (measured, budget)
    assert measured <= 1.05 * predicted, (measured, predicted)
    if not keeps:
        assert measured >= 0.95 * predicted, (measured, predicted)


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_compile_planned_step_that_keeps_ops_is_predicted_from_its_own_compiled_step(family):
    """The tags change what the partitioner saves around them, which the parts measured alone do
    not see: planned from the parts, a plan keeping ops was 6-14 % over its compiled step on
    the CPU suite's GPT-2 (this one under aot_eager: 19 %, 8 % under inductor). The session
    measures the plan's whole step compiled (`measure_plan`) and predicts it from there: within
    5 % both ways (aot_eager: 24 s here, inductor 72 s)."""
    got: list = []
    budget, predicted, measured, keeps = _planned(family, 0.5, "aot_eager", profiles=got)
    assert keeps and got[0].compiled.get("plans"), "the plan's step was not measured"
    assert measured <= budget, (measured, budget)
    assert 0.95 * predicted <= measured <= 1.05 * predicted, (measured, predicted)


@pytest.mark.slow  # ~3 min: inductor compiles of the tiny llama, profiles and steps
def test_under_inductor_the_compiled_profile_predicts_what_the_eager_one_missed():
    """The tiny llama under full recomputation: planned from an eager profile, the inductor step
    holds 20 % more than predicted (over the budget); planned from a compile profile it is
    within 5 % and within the budget, at the least budget and with no checkpointing."""
    budget, predicted, measured, _ = _planned("llama", 0.0, "inductor", compile_profile=False)
    assert measured > 1.05 * predicted  # what the eager profile misses (the issue's +24 %)
    for fraction in (0.0, 1.0):
        budget, predicted, measured, keeps = _planned("llama", fraction, "inductor")
        assert measured <= budget, (fraction, measured, budget)
        assert measured <= 1.05 * predicted, (fraction, measured, predicted)
        if not keeps:
            assert measured >= 0.95 * predicted, (fraction, measured, predicted)


def test_compile_plans_without_offload_and_says_what_conflicts():
    cfg = AdaccConfig(compile=True)
    assert (cfg.compilation.compile, cfg.offloading.offload) == ("inductor", False)
    assert cfg.compression == AdaccConfig().compression  # compression is planned under compile
    cfg = AdaccConfig(compile="inductor", codecs=["int4_outlier"])
    assert cfg.compression.codecs == ["int4_outlier"]
    assert AdaccConfig(compile=False).compilation.compile is None
    with pytest.raises(AdaccError, match="offload has no compiled form"):
        AdaccConfig(compile="inductor", offload=True)
    with pytest.raises(AdaccError, match="backend name"):
        AdaccConfig(compile=3)


def _two_variants(model, batch):
    """Five blocks recompute attention, the next five compress every op."""
    attn = attention_recompute_policy(model, batch)
    mixed = _compressing(model, batch, "aot_eager")
    for name, gp in mixed.groups.items():
        a, c = attn.groups[name].variants[0], gp.variants[0]
        gp.variants = [Variant(5, True, dict(a.actions)), Variant(5, True, dict(c.actions))]
    return mixed


@pytest.mark.parametrize(
    "kind",
    [  # the two-variant policy retains in some blocks and compresses in others
        pytest.param("attention", marks=pytest.mark.slow),
        pytest.param("compress", marks=pytest.mark.slow),
        "two variants",
    ],
)
def test_blocks_compiled_on_their_own_give_eager_adaccs_gradients(kind):
    """Regional compilation (``layer.compile()`` on every block): transformers checkpoints a
    block's ``forward``, so adacc's runtime is traced inside each block's compiled call and runs
    its policy as tags and codec hooks there. Ten blocks, more than dynamo's recompile limit (8):
    they share one graph per variant (each variant's number is the same in every block's runtime,
    and dynamo guards on it). Gradients equal eager Adacc's bit for bit (aot_eager), twice over,
    and a new policy recompiles and trains with its own decisions."""
    model = assets.tiny_model("llama", num_hidden_layers=10)
    model, batch = _model("llama", model)
    planned = {
        "attention": attention_recompute_policy,
        "compress": lambda m, b: _compressing(m, b, "aot_eager"),
        "two variants": _two_variants,
    }[kind](model, batch)
    full = uniform_policy(model, "recompute", batch)
    handle = apply_adacc(model, full)
    want_full = _grads(model, model, batch)
    handle.set_policy(planned)
    eager = _grads(model, model, batch)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    _assert_close(_grads(model, model, batch), eager, 0.0)
    _assert_close(_grads(model, model, batch), eager, 0.0)
    handle.set_policy(full)  # the variant's guard fails: the blocks are traced again
    _assert_close(_grads(model, model, batch), want_full, 0.0)
    handle.remove()


@pytest.mark.slow  # ~22 s: two compile profiles and a compiled step per bucket
def test_a_compile_session_plans_a_new_bucket_compiled_while_its_policy_runs():
    """A longer batch in a compile session is profiled (compiled parts included) and planned
    inside the compiled model's call, while the first bucket's policy is applied; the compiled
    step then trains with the new plan, its gradients equal to the same plan run eagerly."""
    model, batch = _model("llama")
    kw = dict(optimizer="sgd", adaptive=False, profile_repeats=1, compile="aot_eager")
    session = prepare(model, "100GiB", batch, **kw)
    step = torch.compile(model, backend="aot_eager")
    _grads(step, model, batch)
    longer = assets.tiny_batch("llama", model, batch_size=2, seq_len=24)
    plans = len(session.plans)
    got = _grads(step, model, longer)
    assert len(session.plans) == plans + 1
    assert session.plans[session.key_of(longer)].profile.compiled["backend"] == "aot_eager"
    _assert_close(got, _grads(model, model, longer), 0.0)
    session.close()


@pytest.mark.slow  # ~30 s: two compile profiles
def test_the_compiled_profile_skips_the_plain_block_step_that_does_not_fit_its_room(caplog):
    """On a device with a cap, profiling must not pass the budget: the whole step with a plain
    block (full recomputation's bytes plus one block's) is skipped when it does not fit the
    room, and its residual taken as full recomputation's (measured, they differ here)."""
    from adacc_hf import profile_model

    model, batch = _model("llama")
    kw = dict(repeats=1, compile="aot_eager")
    full = profile_model(model, batch, **kw).compiled
    assert full["residual_plain"] != full["residual"]  # so the stand-in below is seen
    with caplog.at_level("INFO", logger="adacc_hf"):
        tight = profile_model(model, batch, room=1, **kw).compiled
    assert tight["residual_plain"] == tight["residual"]
    assert "does not fit" in caplog.text


@pytest.mark.parametrize(
    "codec", ["int4_outlier", "int4_channel", "int4_asym", "int4_naive", "fp8_e4m3", "bitpack"]
)
def test_the_saved_codec_ops_are_the_eager_codecs_and_pass_opcheck(codec):
    """``adacc::saved_encode`` / ``saved_decode`` give the eager codec's decoded tensor bit for bit
    on the same tensor, in its layout (a transposed input and one with permuted leading dims come
    back with their strides), and their schemas and fake implementations pass torch's opcheck
    (what compiled graphs rely on)."""
    from adacc_hf.codecs import get_codec
    from adacc_hf.runtime import saved_codecs

    torch.manual_seed(0)
    x = torch.randn(48, 80)
    x[3, 5] = 40.0  # an outlier
    if codec == "bitpack":  # a dropout mask times its scale
        x = (torch.rand(48, 80) > 0.1).float() / 0.9
    spec = saved_codecs.spec(Action.compress(codec))
    c = get_codec(codec)
    # opcheck's schema test multiplies outputs, which torch has no CPU kernel for in float8
    checks = (
        {"test_utils": ("test_faketensor", "test_aot_dispatch_dynamic")} if "fp8" in codec else {}
    )
    permuted = x.reshape(6, 8, 80).transpose(0, 1)  # dense, last dim innermost: no copy
    for t in (x, x.t(), permuted):
        payload = torch.ops.adacc.saved_encode(t, spec)
        y = torch.ops.adacc.saved_decode(payload, spec, list(t.shape), list(t.stride()), t.dtype)
        assert y.stride() == t.stride()
        assert torch.equal(y, c.decode(c.encode(t)))
        torch.library.opcheck(torch.ops.adacc.saved_encode, (t, spec), **checks)
        args = (payload, spec, list(t.shape), list(t.stride()), t.dtype)
        torch.library.opcheck(torch.ops.adacc.saved_decode, args, **checks)


@pytest.mark.parametrize(
    ("family", "unread"),
    [
        ("llama", ["mlp.down_proj/mm#0", "/add#1"]),
        ("gpt2", ["mlp.c_proj/addmm#0", "/add#1"]),  # (dropout off: see `_model`)
    ],
)
def test_an_op_that_feeds_no_backward_is_neither_saved_nor_recomputed_compiled(family, unread):
    """The trace marks the ops whose outputs backward never reads, nor reads what is made from
    them (``OpSpec.feeds_backward``); the compiled profile prices them at nothing
    (`profiler.compiled.compiled_costs`). Truth, by the allocator: the block compiled retaining
    them holds what full recomputation holds, while retaining an op that feeds backward holds
    more."""
    from adacc_hf.profiler import profile_model
    from adacc_hf.profiler.compiled import compiled_costs
    from adacc_hf.profiler.variants import FULL_RECOMPUTE, block_levels

    model, batch = _model(family)
    probes: dict = {}
    prof = profile_model(model, batch, repeats=1, probes=probes)
    (g,) = prof.groups.values()
    assert [op.key for op in g.ops if not op.feeds_backward] == unread
    probe = next(iter(probes.values()))
    full = block_levels(probe, FULL_RECOMPUTE, None, "aot_eager").held
    kept = Variant(1, True, {k: Action.retain() for k in unread})
    assert block_levels(probe, kept, None, "aot_eager").held == full
    mms = ("aten.mm.default", "aten.addmm.default")
    fed = next(op for op in g.ops if op.feeds_backward and op.aten in mms)
    fed_kept = Variant(1, True, {fed.key: Action.retain()})
    assert block_levels(probe, fed_kept, None, "aot_eager").held >= full + fed.nbytes
    assert any(op.fwd_ms > 0 for op in g.ops if not op.feeds_backward)  # eagerly they cost
    compiled_costs(prof)
    assert all(op.fwd_ms == 0 for op in prof.groups[g.name].ops if not op.feeds_backward)
