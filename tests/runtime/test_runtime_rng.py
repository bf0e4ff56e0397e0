"""Random ops without torch's ``nondeterministic_seeded`` tag (flash-attn's and hub kernels'
dropout, any custom op calling ``torch.rand``) are known by their generator moving: a kept one
replays the RNG as a tagged one does, so the dropouts recomputed after it draw forward's masks.
Checked against the unpatched model: gradients and the later dropout masks, bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import step
from torch import nn

from adacc_hf import Action, apply_adacc, assets, uniform_policy
from adacc_hf.runtime.ops import is_random

P = 0.3


@torch.library.custom_op("adacc_test_rng::noisy", mutates_args=())
def noisy(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout as a custom op (no tag): the output and its scaled keep-mask."""
    keep = (torch.rand_like(x) >= p).to(x.dtype) / (1 - p)
    return x * keep, keep


@noisy.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, grad_keep):
    (keep,) = ctx.saved_tensors
    return grad * keep, None


noisy.register_autograd(_backward, setup_context=_setup)
NOISY = torch.ops.adacc_test_rng.noisy.default


@torch.library.custom_op("adacc_test_rng::bernoulli_fill_", mutates_args=("t",))
def bernoulli_fill_(t: torch.Tensor, p: float) -> None:
    """An in-place RNG fill as a custom op (no tag)."""
    t.bernoulli_(1 - p)


FILL = torch.ops.adacc_test_rng.bernoulli_fill_.default


class Noisy(nn.Module):
    """The random op makes the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return noisy(x, P)[0]


class NoisyFill(nn.Module):
    """The random op fills a fresh tensor in place (as CPU dropout's ``bernoulli_`` does): the
    trace sees a mask op, and the runtime keeps the tensor at its first use."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.empty_like(x)
        bernoulli_fill_(keep, P)
        return x * keep / (1 - P)


class MaskSpy(nn.Dropout):
    """``nn.Dropout`` that records each call's keep-mask (forward and recompute alike)."""

    def __init__(self, p: float, log: list) -> None:
        super().__init__(p)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.log.append((out != 0).detach().clone())
        return out


def _model(log: list, noise: type[nn.Module]):
    """Tiny LLaMA: the custom random op right after the input norm; dropout after it in SDPA
    and after the post-attention norm (recorded)."""
    model = assets.tiny_model("llama", attention_dropout=0.2)
    for block in model.model.layers:
        block.input_layernorm = nn.Sequential(block.input_layernorm, noise())
        block.post_attention_layernorm = nn.Sequential(
            block.post_attention_layernorm, MaskSpy(P, log)
        )
    return model


@pytest.mark.parametrize(
    ("noise", "kept_aten", "action"),
    [
        (Noisy, str(NOISY), Action.retain()),
        (NoisyFill, "aten.empty_like.default", Action.compress("bitpack")),
    ],
    ids=["random-op-retained", "random-fill-bitpacked"],
)
def test_a_kept_random_op_without_the_tag_replays_the_rng(noise, kept_aten, action):
    assert not is_random(NOISY) and not is_random(FILL)  # the premise: torch does not know
    log: list = []
    model = _model(log, noise)
    batch = assets.tiny_batch("llama", model)
    ref_loss, ref_grads, _ = step(model, batch)
    ref_masks = list(log)
    n_blocks = len(model.model.layers)
    assert len(ref_masks) == n_blocks

    policy = uniform_policy(model, "recompute", batch)
    g = policy.groups["block"]
    kept = [o for o in g.ops if o.aten == kept_aten and o.key.startswith("input_layernorm.1/")]
    assert len(kept) == 1 and kept[0].cacheable
    assert kept[0].mask == (noise is NoisyFill)  # a fill by an RNG op: a keep-mask
    g.variants[0].actions[kept[0].key] = action
    with apply_adacc(model, policy) as handle:
        for _ in range(2):  # the step that builds the slot tables, then one that reuses them
            log.clear()
            loss, grads, _ = step(model, batch)
            assert not handle.problems
            assert all(n > 0 for n in handle.cached_bytes().values())  # the op was kept
            # forward's masks, then the recompute's (backward runs the blocks in reverse)
            assert len(log) == 2 * n_blocks
            forward, recompute = log[:n_blocks], log[n_blocks:][::-1]
            for ref, fwd, rec in zip(ref_masks, forward, recompute, strict=True):
                assert torch.equal(fwd, ref) and torch.equal(rec, ref)
            assert torch.equal(loss, ref_loss)
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
