"""One rule gives ops their keys (`ops.key_kind`): the profile trace, the forward and the
recompute assign the same keys to the same ops, on a block that exercises every clause of the
rule (ops under ``no_grad`` with and without an input that requires grad, parameter casts under
autocast, views, in-place ops, an op returning an integer beside its tensor). Seen from outside:
the trace's op list, the slot table the forward built, the positions the forward and the
recompute counted; gradients bitwise equal to the unpatched model's."""

from __future__ import annotations

import torch
from conftest import step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

from adacc_hf import Action, apply_adacc, assets, trace_model
from adacc_hf.policy import builders
from adacc_hf.runtime import modes
from adacc_hf.runtime.ops import is_keyed


@torch.library.custom_op("adacc_test_keys::with_count", mutates_args=())
def with_count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A tensor and an integer (as CUDA flash attention returns)."""
    return x * 2, x.shape[-1]


@with_count.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return torch.empty_like(x), x.shape[-1]


def _setup(ctx, inputs, output) -> None:
    pass


def _backward(ctx, grad, grad_count):
    return grad * 2


with_count.register_autograd(_backward, setup_context=_setup)
WITH_COUNT = "adacc_test_keys.with_count.default"


class Clauses(nn.Module):
    """Wraps a block's MLP (its linears cast their weights under autocast) with the rest."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.detach().abs().amax() + 1  # no key: nothing here requires grad
            shift = x.mean()  # a key: its input requires grad
        y = self.mlp(x).transpose(1, 2).transpose(1, 2)  # views
        z = y * 1.5
        z.add_(shift)  # in place
        z, n = with_count(z)
        return z / (scale * n)


def _model():
    model = assets.tiny_model("llama", attention_dropout=0.2)
    for block in model.model.layers:
        block.mlp = Clauses(block.mlp)
    return model


class _Clauses(TorchDispatchMode):
    """Counts the calls of each clause in one forward (the test's premise)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = dict.fromkeys(("no_grad", "param_cast", "view", "in_place", "ints"), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_keyed(func) and not torch.is_grad_enabled():
            self.n["no_grad"] += 1
        if func is torch.ops.aten._to_copy.default and args[0].is_leaf and args[0].requires_grad:
            self.n["param_cast"] += 1
        self.n["view"] += func.is_view
        self.n["in_place"] += func._schema.is_mutable
        self.n["ints"] += str(func) == WITH_COUNT
        return out


def _spy(monkeypatch, cls, log: dict) -> None:
    """Record (position, op) of every keyed op a mode counts, per checkpointed run."""
    original = cls.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        pos = self.pos
        out = original(self, func, types, args, kwargs)
        if self.pos != pos:
            log.setdefault(id(self.run), []).append((pos, func))
        return out

    monkeypatch.setattr(cls, "__torch_dispatch__", counted)


def test_trace_forward_and_recompute_assign_the_same_keys(monkeypatch):
    model = _model()
    batch = assets.tiny_batch("llama", model)
    bf16 = torch.bfloat16
    with torch.autocast("cpu", dtype=bf16), _Clauses() as clauses:
        model(**batch)
    assert all(clauses.n.values()), clauses.n  # every clause of the rule is exercised

    with torch.autocast("cpu", dtype=bf16):
        ref_loss, ref_grads, _ = step(model, batch)
    trace = trace_model(model, batch, autocast=bf16)
    traced = [(o.key, o.aten) for o in trace.groups["block"].ops]
    assert any(aten == WITH_COUNT for _, aten in traced)
    # Keep the last keyed op: the recompute counts every position up to it.
    policy = builders.uniform(trace, "recompute")
    g = policy.groups["block"]
    g.variants[0].actions[traced[-1][0]] = Action.retain()

    forward: dict = {}
    recompute: dict = {}
    _spy(monkeypatch, modes._KeepMode, forward)  # _BuildMode counts through it too
    _spy(monkeypatch, modes._ReplayMode, recompute)
    with apply_adacc(model, policy) as handle:
        for _ in range(2):  # the step that builds the slot tables, then one that reuses them
            forward.clear()
            recompute.clear()
            # The whole recompute (early stop would end it before the block's last ops).
            with torch.autocast("cpu", dtype=bf16), set_checkpoint_early_stop(False):
                loss, grads, _ = step(model, batch)
            assert not handle.problems and not handle.unknown_ops
            assert torch.equal(loss, ref_loss)
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
            assert len(forward) == len(recompute) == len(model.model.layers)
            for run, ops in forward.items():
                assert [p for p, _ in ops] == list(range(len(traced)))
                assert [str(f) for _, f in ops] == [a for _, a in traced]
                assert recompute[run] == ops  # the same op at every position
        for rt in handle.runtimes.values():
            (table,) = rt._tables.values()
            assert [(s.key, str(s.func)) for s in table.slots] == traced
