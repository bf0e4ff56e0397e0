"""Slot tables are keyed by what decides a block's op sequence, with lengths rounded up to their
bucket: under dynamic padding a run builds one table per bucket (and policy variant), not one
per length. Correctness never rests on that key: a block whose op sequence changes within a
bucket is detected and keeps nothing until its own table is built, and what a table holds per
position does not depend on the length it was built at. Builds are counted on
`modes.build_table`; gradients are compared with the unpatched model's, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import random_policy, step
from torch import nn

from adacc_hf import apply_adacc, assets
from adacc_hf.runtime import modes
from adacc_hf.schema.buckets import bucket_edge


@pytest.fixture
def builds(monkeypatch) -> list:
    """Counts slot-table builds."""
    count: list = []
    original = modes.build_table

    def counted(*args, **kwargs):
        count.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(modes, "build_table", counted)
    return count


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(model, length: int, rows: int = 1) -> dict:
    return assets.tiny_batch("llama", model, batch_size=rows, seq_len=length)


def test_five_hundred_lengths_build_one_table_per_bucket(builds):
    model = assets.tiny_model("llama", max_position_embeddings=512)
    policy = random_policy(model, _batch(model, 64))  # a mix of retained and recomputed ops
    lengths = list(range(4, 504))
    random.Random(0).shuffle(lengths)
    with apply_adacc(model, policy) as handle:
        for n in lengths:
            model(**_batch(model, n))  # the forward builds (or finds) the tables
            assert all(b > 0 for b in handle.cached_bytes().values()), n  # the policy acts
        assert not handle.problems
    buckets = {bucket_edge(n) for n in lengths}
    assert len(builds) <= len(buckets) * len(model.model.layers)  # 20 buckets, not 500 lengths


def test_per_bucket_plans_keep_their_tables_across_switches(builds):
    """The plans of two buckets (traced at their own lengths, as a session plans them) alternate
    step by step: each block builds one table per plan, once."""
    model = assets.tiny_model("llama")
    short = random_policy(model, _batch(model, 16, rows=2))
    long = random_policy(model, _batch(model, 96, rows=2))
    with apply_adacc(model, short) as handle:
        for i in range(12):
            n = 9 + i // 2 if i % 2 == 0 else 90 + i // 2  # buckets 16 and 96
            handle.set_policy(short if i % 2 == 0 else long)
            step(model, _batch(model, n, rows=2))
            assert all(b > 0 for b in handle.cached_bytes().values())
        assert not handle.problems
    assert len(builds) == 2 * len(model.model.layers)


class Branchy(nn.Module):
    """An MLP that runs one op more at odd lengths: the op sequence changes within a bucket."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2:
            x = x * 1.0
        return self.mlp(x)


def test_a_block_whose_ops_change_with_the_length_stays_exact(builds):
    model = assets.tiny_model("llama")
    for block in model.model.layers:
        block.mlp = Branchy(block.mlp)
    lengths = list(range(33, 41))  # one bucket (40), odd and even
    assert {bucket_edge(n) for n in lengths} == {40}
    refs = {n: step(model, _batch(model, n, rows=2)) for n in lengths}
    policy = random_policy(model, _batch(model, 40, rows=2))
    order = [34, 35, 36, 33, 40, 37, 38, 39]
    with apply_adacc(model, policy) as handle:
        for rnd in range(3):
            before = len(builds)
            for n in order:
                loss, grads, _ = step(model, _batch(model, n, rows=2))
                ref_loss, ref_grads, _ = refs[n]
                assert torch.equal(loss, ref_loss), n
                assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads), n
                if rnd:  # 35 found 34's table, kept nothing and left the bucket to exact sizes
                    assert all(b > 0 for b in handle.cached_bytes().values()), n
        assert len(builds) == before  # the third round built nothing: every length has a table


def test_a_table_holds_nothing_of_the_length_it_was_built_at(builds):
    """Compressed ops: a table built at one length, used at another of its bucket, keeps the same
    bytes and gives the same gradients as a table built at that length itself."""
    model = assets.tiny_model("llama")
    policy = random_policy(model, _batch(model, 40), kinds=("retain", "compress", "recompute"))
    assert any(a.kind == "compress" for a in policy.groups["block"].variants[0].actions.values())
    with apply_adacc(model, policy) as handle:
        step(model, _batch(model, 33, rows=2))
        at33 = dict(handle.runtimes["model.layers.0"].last_bytes)
        shared = step(model, _batch(model, 39, rows=2))
        shared_bytes = {p: dict(rt.last_bytes) for p, rt in handle.runtimes.items()}
        assert len(builds) == len(model.model.layers)  # 39 ran on the table built at 33
    with apply_adacc(model, policy) as handle:
        own = step(model, _batch(model, 39, rows=2))
        own_bytes = {p: dict(rt.last_bytes) for p, rt in handle.runtimes.items()}
    assert len(builds) == 2 * len(model.model.layers)
    assert shared_bytes == own_bytes and shared_bytes["model.layers.0"] != at33
    assert torch.equal(shared[0], own[0])
    assert all(torch.equal(shared[1][k], own[1][k]) for k in own[1])
