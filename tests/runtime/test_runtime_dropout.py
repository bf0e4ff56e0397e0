"""Dropout masks are policy ops: kept bit-packed at 1 bit per element through the runtime, with
gradients bitwise equal to the unpatched model, whether the mask is CPU dropout's float noise
(an RNG op fills a fresh tensor in place) or ``native_dropout``'s bool output (CUDA's path,
forced here on CPU). Memory is measured independently (live storages), and the solver keeps
masks when that is the cheapest way to fit the budget."""

from __future__ import annotations

import pytest
import torch
from conftest import step
from torch import nn

from adacc_hf import Action, activation_memory_report, apply_adacc, assets, uniform_policy


def _masks_bitpacked(model, batch):
    """Recompute everything except the dropout masks, which are kept bit-packed."""
    policy = uniform_policy(model, "recompute", batch)
    n = 0
    for g in policy.groups.values():
        for op in g.ops:
            if op.mask:
                g.variants[0].actions[op.key] = Action.compress("bitpack")
                n += 1
    return policy, n


class NativeDropout(nn.Dropout):
    """``F.dropout`` as CUDA runs it: one ``native_dropout`` op returning (output, bool mask)."""

    def forward(self, x):
        return torch.native_dropout(x, self.p, self.training)[0]


def _native(model):
    for block in model.transformer.h:
        for name, mod in list(block.named_modules()):
            if type(mod) is nn.Dropout:
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                setattr(parent, name.rpartition(".")[2], NativeDropout(mod.p))
    return model


@pytest.mark.parametrize(
    ("family", "native"),
    [("gpt2", False), ("llama", False), ("bert", False), ("t5", False), ("gpt2", True)],
    ids=["gpt2", "llama", "bert", "t5", "gpt2-native_dropout"],
)
def test_dropout_masks_are_kept_at_one_bit_with_bitwise_equal_gradients(family, native):
    if family == "llama":
        model = assets.tiny_model("llama", attention_dropout=0.2)  # masks inside SDPA's math
    else:
        model = assets.tiny_model(family)
    if native:
        model = _native(model)
    batch = assets.tiny_batch(family, model)
    ref_loss, ref_grads, _ = step(model, batch)
    policy, n = _masks_bitpacked(model, batch)
    assert n > 0
    masks = {g: [o for o in gp.ops if o.mask] for g, gp in policy.groups.items()}
    if native:
        assert any(o.aten == "aten.native_dropout.default" for ms in masks.values() for o in ms)
    with apply_adacc(model, uniform_policy(model, "recompute", batch)):
        torch.manual_seed(0)
        base = activation_memory_report(model, batch)
    with apply_adacc(model, policy) as handle:
        loss, grads, _ = step(model, batch)
        loss2, grads2, _ = step(model, batch)  # slot tables built: the fast path
        torch.manual_seed(0)
        held = activation_memory_report(model, batch)
        assert not handle.problems
        for path, rt in handle.runtimes.items():
            expect = 0
            for op in masks[rt.group]:
                bits = (torch.Size(op.shape).numel() + 7) // 8
                is_float = op.aten != "aten.native_dropout.default"  # native: a bool mask
                expect += bits + (torch.finfo(getattr(torch, op.dtype[6:])).bits // 8) * is_float
                assert op.key in rt.last_bytes
            assert sum(rt.last_bytes.values()) == expect, path  # 1 bit per element (+ scale)
            assert held.blocks[path] == base.blocks[path] + expect, path  # measured, exactly
    for got_loss, got in ((loss, grads), (loss2, grads2)):
        assert torch.equal(got_loss, ref_loss)
        assert all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)


def test_a_kept_mask_replays_the_rng_for_the_dropouts_recomputed_after_it():
    """GPT-2: keep only the attention-dropout mask; the residual dropouts after it are
    recomputed and must draw the masks forward drew, so replay restores the generator as the
    skipped fill left it."""
    model = assets.tiny_model("gpt2")
    batch = assets.tiny_batch("gpt2", model)
    ref_loss, ref_grads, _ = step(model, batch)
    policy = uniform_policy(model, "recompute", batch)
    g = policy.groups["block"]
    attn_masks = [o for o in g.ops if o.mask and o.layer_type == "attn_dropout"]
    later = [o for o in g.ops if o.mask and o.layer_type == "dropout"]
    assert attn_masks and later
    for o in attn_masks:
        g.variants[0].actions[o.key] = Action.compress("bitpack")
    with apply_adacc(model, policy):
        step(model, batch)
        loss, grads, _ = step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_the_solver_keeps_masks_bit_packed_when_that_is_the_cheapest_fit():
    """On a device where regenerating a mask costs more than bit-packing it (made so here by
    the profile's timing; the CPU measures otherwise), a budget with room for bits but not for
    float masks gets bit-packed masks, and the runtime applies them exactly (with only lossless
    choices allowed, so that the whole policy is exact)."""
    from adacc_hf import profile_model, solve_policy
    from adacc_hf.policy.builders import uniform
    from adacc_hf.solver.cost_model import predict

    # 8 blocks at seq 32: the step peak sits where the blocks' kept tensors are, so a kept float
    # mask raises it (at 2 blocks / seq 16 the LM head's peak hides them, and whether the solver
    # then fills that free room with float masks or with other ops is a timing tie).
    model = assets.tiny_model("gpt2", n_layer=8)
    batch = assets.tiny_batch("gpt2", model, seq_len=32)
    prof = profile_model(model, batch, repeats=2)
    g = prof.groups["block"]
    masks = [o for o in g.ops if o.mask]
    assert masks and all(set(o.codecs) == {"bitpack"} for o in masks)
    for o in masks:  # measured on the real masks: lossless, 1 bit per element (+ scale)
        cp = o.codecs["bitpack"]
        assert cp.rel_error == 0 and cp.nbytes == (torch.Size(o.shape).numel() + 7) // 8 + 4
    ops = []
    for o in g.ops:
        if o.mask:
            o = type(o)(**{**o.__dict__, "fwd_ms": 50.0})  # an expensive RNG
            o.codecs["bitpack"].encode_ms, o.codecs["bitpack"].decode_ms = 0.01, 0.01
        ops.append(o)
    g.ops = ops

    def peak(**kept: Action) -> int:  # full recomputation but the masks packed, `kept` so
        policy = uniform(prof, "recompute")
        for v in policy.groups["block"].variants:
            v.actions.update({o.key: Action.compress("bitpack") for o in masks}, **kept)
        return predict(prof, policy).peak_nbytes

    bits = peak()
    one_float = min(peak(**{o.key: Action.retain()}) for o in masks)
    assert one_float > bits  # the premise: a float mask costs room that packed bits do not
    budget = (bits + one_float) // 2  # bits fit, no float mask does
    # Lossless choices only: the test compares gradients bit for bit. The room left beside the
    # bits is otherwise the solver's to fill, and under priced dispatch overhead (a block that
    # keeps a mask pays it anyway) it may fill it with lossy codecs where they beat recomputing.
    policy = solve_policy(prof, budget, split_blocks=False, max_rel_error=0.0)
    kept = {
        k: a
        for v in policy.groups["block"].variants
        for k, a in v.actions.items()
        if a.kind != "recompute"
    }
    assert {o.key for o in masks} <= set(kept)
    assert all(kept[o.key] == Action.compress("bitpack") for o in masks)
    assert predict(prof, policy).peak_nbytes <= budget
    ref_loss, ref_grads, _ = step(model, batch)
    with apply_adacc(model, policy):
        loss, grads, _ = step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
