"""The pieces every benchmark driver in ``benchmarks/`` is built from.

The drivers (``bench_throughput.py``, ``accuracy.py``, ``gpu_suite.py``, ``plan_sweep.py``,
``bench_solver.py``, ``bench_codecs.py``, ``codec_grad_error.py``, ``plot_policy.py``) parse
their command line and put these pieces (or the library's own) together.

What is compared:
    strategies      the registry: every strategy's name, label, kind and whether it needs a budget
    prepared        how each kind is prepared, installed and uninstalled (exactly undone)
    patching        what a strategy may change on a model; transformers' own checkpointing switch
    adacc           Adacc as users get it: its profile, the no-outlier ablation, budget range
What runs:
    models          throughput presets (transformers configs, SmolLM2)
    tasks           accuracy tasks (Shakespeare blocks; SmolLM2 fine-tuning, GPT-2 from scratch)
    synthetic       synthetic block profiles for the solver benchmark
How it is measured:
    steps           one training step; steps timed round-robin across strategies, medians
    stats           comparisons round by round: bootstrap intervals, holds / fails / undecided
    memory          activations held, a step's peak (CPU: live storages; CUDA: the allocator)
    search          the largest micro-batch that fits (doubling, then bisection)
    throughput      one model's throughput suite (budget, batch sweep, ample memory, max batch)
    training        one accuracy run per strategy, held-out loss, the budget where Adacc compresses
    sweep           a budget sweep: solved policies, predicted against measured memory
    codecs          codec kernels against their torch references (time, bandwidth, bit-exactness)
How it is written:
    env             device, dtype, threads, file tag, time limit, the header of every results JSON
    report          JSON writing, console rows and README markdown tables
    plots           throughput / memory / summary and loss-curve figures
    policy_picture  a per-op policy as a picture (ops x blocks)

Library logic is not copied here: timing comes from `adacc_hf.runtime.timing`, budgets and
predictions from `adacc_hf.solver`, fixed policies from `adacc_hf.uniform_policy` & co.
"""

import os as _os

# A benchmark prints its own table rows; adacc's plan lines and profiling bars (INFO, shown by
# default to users) would interleave with them. ADACC_VERBOSITY=info brings them back.
if "ADACC_VERBOSITY" not in _os.environ:
    import adacc_hf as _adacc_hf

    _adacc_hf.set_verbosity("warning")
