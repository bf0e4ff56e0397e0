"""`timing.steady_ms` on a modelled GPU: the host's cost is hidden where the device is busier (a
step's blocks run back to back, so the host issues one block while the device runs the one
before), and shows where the host is the slower. Checked against the analytic times of
uniform ops (n ops of `h` host seconds and `d` device seconds each: the second of two runs takes
n * max(h, d)), not against the clock's own arithmetic; and the dispatch overhead the profiler
measures with it (`overhead.dispatch_overhead_ms`) is zero for a block whose kernels outlast the
host's Python and what the host adds for one that does not."""

from __future__ import annotations

import pytest
import torch

from adacc_hf.devices.dryrun import dry_run
from adacc_hf.devices.roofline import Roofline, op_bytes, op_flops
from adacc_hf.devices.table import load_device
from adacc_hf.runtime import timing
from adacc_hf.runtime.modes import crossings


def _matmuls(n: int, size: int):
    a = torch.empty(size, size)
    b = torch.empty(size, size)

    def fn() -> None:
        for _ in range(n):
            torch.mm(a, b)

    return fn, a, b


def _op_seconds(roofline: Roofline, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(host, device) seconds of one ``mm(a, b)``, from the table's figures."""
    func = torch.ops.aten.mm.default
    out = torch.empty(a.shape[0], b.shape[1])
    kind, flops = op_flops(func, (a, b), {}, out)
    assert kind == "matmul"
    return roofline.host_s(0), roofline.seconds(kind, flops, op_bytes((a, b), {}, out))


@pytest.mark.parametrize("size", [64, 4096])
def test_the_second_of_two_runs_takes_the_slower_of_host_and_device(size):
    roofline = Roofline(load_device("h200"))
    fn, a, b = _matmuls(50, size)
    host, device = _op_seconds(roofline, a, b)
    assert (device > host) == (size == 4096)  # one case of each: device-bound and host-bound
    with dry_run(roofline):
        steady = timing.steady_ms(fn, "cpu")
        lone = timing.time_call(fn, "cpu", 1)
    assert steady == pytest.approx(50 * max(host, device) * 1e3, rel=1e-9)
    # a lone synchronised run also waits for the first issue before the device starts
    assert lone == pytest.approx((host + 50 * max(host, device)) * 1e3 if device > host else
                                 (50 * host + device) * 1e3, rel=1e-9)  # fmt: skip


def _forward_ops(model, rows: int, seq: int, roofline: Roofline) -> int:
    """Ops one block's forward dispatches (each crosses the keep mode once when it keeps any)."""
    hidden = model.config.hidden_size
    with dry_run(roofline) as mode:
        x = torch.empty(rows, seq, hidden, dtype=torch.bfloat16)
        emb = model.model.rotary_emb(x, torch.arange(seq)[None])
        before = mode.ops
        model.model.layers[0](x, position_embeddings=emb)
        return mode.ops - before


def test_dispatch_overhead_is_what_the_host_adds_beyond_the_devices_kernels():
    """Profiled on the H200 table as `plan --device` profiles: a narrow LLaMA block is
    host-bound there, so the dispatch modes' Python is paid in full (every op of its forward
    crosses a mode, in forward and again in the recompute: at least 2 x ops x a crossing's
    cost); the 1.1B LLaMA's block at 4 x 2048, whose kernels outlast that Python, pays nothing."""
    from transformers import LlamaConfig

    from adacc_hf.devices.host_model import empty_model
    from adacc_hf.devices.plan import random_batch
    from adacc_hf.profiler import profile_model

    roofline = Roofline(load_device("h200"))
    got = {}
    for hidden, inner, rows, seq in ((64, 256, 1, 16), (2048, 5632, 4, 2048)):
        config = LlamaConfig(
            hidden_size=hidden, intermediate_size=inner, num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 512), num_hidden_layers=2, vocab_size=256,
            use_cache=False,
        )  # fmt: skip
        model = empty_model(config)
        with dry_run(roofline), torch.random.fork_rng(devices=[]):
            prof = profile_model(
                model, random_batch(config, rows, seq), codecs=[], repeats=1, warmup=0
            )
        (group,) = prof.groups.values()
        got[hidden] = group.dispatch_ms, _forward_ops(model, rows, seq, roofline)
    assert crossings() == 0
    assert got[2048][0] == 0.0
    narrow, ops = got[64]
    per_crossing_ms = roofline.table.efficiency["host_mode_us"] * 1e-3
    assert narrow >= 2 * ops * per_crossing_ms * 0.99, (narrow, ops)
