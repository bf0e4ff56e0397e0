"""Shared helpers: tiny per-family models and one seeded training step."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from adacc_hf import assets, trace_model
from adacc_hf.policy.builders import random_mix

FAMILIES = assets.SUPPORTED_FAMILIES


def random_policy(model, batch=None, *, seed: int = 0, kinds=("retain", "recompute")):
    """A random mix of actions over `model`'s traced ops (see `builders.random_mix`)."""
    return random_mix(trace_model(model, batch), seed=seed, kinds=kinds)


def step(model, batch, seed: int = 1234):
    """Forward + backward with a fixed dropout seed; returns (loss, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def grad_rel_error(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters together."""
    assert grads.keys() == ref.keys()
    diff = torch.cat([(grads[k] - ref[k]).flatten() for k in ref])
    base = torch.cat([ref[k].flatten() for k in ref])
    return (diff.norm() / base.norm()).item()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def tiny(family):
    model = assets.tiny_model(family)
    return model, assets.tiny_batch(family, model)
