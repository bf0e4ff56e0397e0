"""Each rank's real step peak against Adacc's prediction: DDP, FSDP2, ZeRO-2 or ZeRO-3, over gloo.

    torchrun --standalone --nproc_per_node 2 rank_peak.py --engine ddp --out D

Every rank builds the engine, profiles (rank 0 solves) for a per-device budget between full
recomputation's need and no checkpointing's (rank 0's, shared), trains warm-up steps (DDP rebuilds
its buckets after the first, ZeRO-3 traces its prefetch order), then measures one step with
`measure_step_peak` and the next with `ProcessMeter`: every byte the CPU allocator holds, on any
thread, DDP's C++-held buckets, ZeRO's flat buffers and gloo's collective buffers included
(`measure_step_peak` counts what it can reach from the model, the optimizer and the batch, and
sees only the calling thread's allocations). Each rank writes `{engine}_rank{r}.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from common import global_rows, kinds, mixed_budget, shard, write
from torch.profiler import ProfilerActivity, profile

import adacc_hf
from adacc_hf import assets
from adacc_hf.engine.sharding import sharding_from_model
from adacc_hf.solver import estimate_static_memory, predict

ENGINES = ("ddp", "fsdp2", "zero2", "zero3")


def count_every_thread() -> None:
    """Make torch's CPU allocator count every allocation and free, on any thread (gloo's worker
    threads free collective buffers), in the running total each profiler event carries."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


class ProcessMeter:
    """Bytes the process's CPU allocator holds (everything allocated since `count_every_thread`,
    all threads): at the first allocation inside the block, and at its highest."""

    def __enter__(self) -> ProcessMeter:
        self._marks: dict[str, int] = {}
        self.phases: dict[str, int] = {}
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        events, stack = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                f = node.extra_fields
                events.append((node.start_time_ns, int(f.total_allocated), int(f.alloc_size)))
            elif node.name.startswith("mark:"):
                self._marks[node.name[5:]] = node.start_time_ns
        events.sort()
        self.start_nbytes = events[0][1] - events[0][2]
        self.peak_nbytes = max(total for _, total, _ in events)
        edges = sorted(self._marks.items(), key=lambda kv: kv[1])
        lo = 0
        for name, t in edges:  # the highest level before each mark (since the previous one)
            totals = [total for when, total, _ in events if lo <= when < t]
            self.phases[name] = max(totals, default=0)
            lo = t

    def mark(self, name: str) -> None:
        with torch.profiler.record_function("mark:" + name):
            pass


def train_step(
    model: Any, batch: dict[str, torch.Tensor], opt: Any, meter: ProcessMeter | None = None
) -> None:
    mark = meter.mark if meter is not None else lambda name: None
    loss = model(**batch).loss
    mark("forward")
    loss.backward()
    del loss
    mark("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark("optimizer")


class EngineOptimizer:
    """A DeepSpeed engine's step behind the optimizer interface `measure_step_peak` calls."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def state(self) -> dict:
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        return inner.state

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()


def ds_config(stage: int, rows: int, n: int, hidden: int) -> dict[str, Any]:
    """The recipes' ZeRO config with Accelerate's "auto" values filled in for `hidden`; ZeRO-3
    shards every parameter (tiny ones are persistent by default)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": hidden * hidden}  # fmt: skip
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 0,
        }
    else:
        zero["allgather_bucket_size"] = int(5e8)
    return {
        "train_micro_batch_size_per_gpu": rows,
        "train_batch_size": rows * n,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build(engine: str, args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(the module Adacc patches, what a step calls, the optimizer, sharding fields)."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = assets.tiny_model(
        "llama", seed=0, attention_dropout=0.0, num_hidden_layers=args.layers,
        hidden_size=args.hidden, intermediate_size=2 * args.hidden,
    )  # fmt: skip
    if engine == "ddp":
        return model, model, None, {}  # wrapped after profiling, inside the tracker
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        return model, model, opt, sharding_from_model(model)
    import deepspeed

    stage = int(engine[-1])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cfg = ds_config(stage, args.rows // n, n, args.hidden)
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    del r
    return ds.module, ds, EngineOptimizer(ds), sharding_from_model(ds)


def run(engine: str, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    r, n = dist.get_rank(), dist.get_world_size()
    module, step_model, opt, fields = build(engine, args)
    cfg = module.config
    first = shard(global_rows(1, args.rows, args.seq_len, cfg), r, n)
    if engine == "ddp":
        fields = {"ddp": True, "world_size": n}  # wrapped below, after profiling
    budget = [mixed_budget(module, first, args.fraction, optimizer="adamw_torch", **fields)]
    dist.broadcast_object_list(budget, src=0)  # one budget: each rank's profile differs a little
    budget = budget[0]
    session = adacc_hf.prepare(
        module, budget, first, optimizer="adamw_torch", max_codec_error=0, adaptive=False, **fields
    )
    if engine == "ddp":  # Accelerate's and the Trainer's defaults (gradient_as_bucket_view off)
        step_model = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.AdamW(step_model.parameters(), lr=args.lr)
    del first
    for step in range(1, args.warmup + 1):
        train_step(step_model, shard(global_rows(step, args.rows, args.seq_len, cfg), r, n), opt)
    batch = shard(global_rows(args.warmup + 1, args.rows, args.seq_len, cfg), r, n)
    tracked = adacc_hf.measure_step_peak(step_model, batch, opt)
    batch = shard(global_rows(args.warmup + 2, args.rows, args.seq_len, cfg), r, n)
    gc.collect()
    with ProcessMeter() as meter:
        train_step(step_model, batch, opt, meter)
    pred = session.policy.metadata["predicted"]
    static = session.static
    # The plan fits the worst rank (ZeRO-2: the last, whose gradient partition comes first); this
    # rank's own prediction runs the engine rules for it.
    own = estimate_static_memory(module, **session.config.run.static_options(), rank=r)
    report = {
        "engine": engine,
        "rank": r,
        "world_size": n,
        "sharding": {k: v for k, v in session.config.run.static_options().items() if k in fields},
        "budget_nbytes": budget,
        "predicted_nbytes": pred["peak_nbytes"],
        "predicted_moment": pred["peak_moment"],
        "predicted_own_nbytes": predict(session.profile, session.policy, own).peak_nbytes,
        "measured_nbytes": meter.peak_nbytes,
        "measured_start_nbytes": meter.start_nbytes,
        "measured_phases": meter.phases,
        "predicted_moments": predict(
            session.profile, session.policy, session.ctx.static_memory()
        ).moments,
        "measure_step_peak_nbytes": tracked.peak_nbytes,
        "measure_step_peak_phases": tracked.phases,
        "static": None if static is None else asdict(static),
        "kinds": kinds(session.policy),
        "fingerprint": session.policy.fingerprint(),
        "seconds": time.perf_counter() - t0,
    }
    session.close()
    write(args.out, engine, report)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rows", type=int, default=4, help="global batch (rows per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fraction", type=float, default=0.4)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    count_every_thread()
    if args.engine.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    try:
        run(args.engine, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
