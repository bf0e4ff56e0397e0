"""Retain / recompute on the test device with its fast kernels: gradients as exact as the device is.

On a CPU every kernel is deterministic: a policy's loss and gradients are bitwise equal to the
unpatched step's. On CUDA (``ADACC_TEST_DEVICE=cuda``) the fast attention backends (flash,
memory-efficient) accumulate their backward with atomics, so two runs of the very same unpatched
step differ: a policy is held to 8x that measured spread (and a floor of 1e-6 relative in fp32,
1e-3 in bf16, for runs whose spread happens to be 0). A wrong dropout mask in a recompute, the bug
this guards against, moves gradients by tens of percent. The bitwise tests elsewhere run on CUDA
with deterministic algorithms and the math backend (``conftest.deterministic_device``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE, grad_rel_error, random_policy, step

from adacc_hf import apply_adacc, assets, attention_recompute_policy, uniform_policy

pytestmark = pytest.mark.fast_kernels
CUDA = TEST_DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
POLICIES = {
    "full_recompute": lambda m, b: uniform_policy(m, "recompute", b),
    "attention_core_recompute": attention_recompute_policy,
    "random_mix": lambda m, b: random_policy(m, b, seed=3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_policies_give_the_unpatched_gradients_within_the_devices_own_spread(family, policy, dtype):
    model = assets.tiny_model(family).to(device=TEST_DEVICE, dtype=dtype)
    batch = assets.tiny_batch(family, model, batch_size=2, seq_len=32)
    ref_loss, ref, _ = step(model, batch)
    again_loss, again, _ = step(model, batch)
    spread = grad_rel_error(again, ref)
    with apply_adacc(model, POLICIES[policy](model, batch)) as handle:
        loss, grads, _ = step(model, batch)
    assert not handle.unknown_ops
    if not CUDA:
        assert spread == 0.0 and torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[k], ref[k]) for k in ref)
        return
    err = grad_rel_error(grads, ref)
    assert err <= max(8 * spread, FLOOR[dtype]), (err, spread)
    assert abs(float(loss) - float(ref_loss)) <= max(
        8 * abs(float(again_loss) - float(ref_loss)), FLOOR[dtype] * abs(float(ref_loss))
    )


def test_dropout_really_draws_on_the_device():
    """The check above is not vacuous: the tiny models' dropout is active on the device, so the
    recompute's random numbers must be replayed to match."""
    model = assets.tiny_model("llama").to(TEST_DEVICE)
    batch = assets.tiny_batch("llama", model, batch_size=2, seq_len=32)
    torch.manual_seed(0)
    a = model(**batch).loss
    torch.manual_seed(1)
    b = model(**batch).loss
    assert not torch.equal(a, b)
