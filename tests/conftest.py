"""Shared helpers: tiny per-family models and one seeded training step.

The tests follow the package: ``tests/<package>/`` holds the tests of ``src/adacc_hf/<package>``
(``tests/kernels/``: the Triton kernels; ``tests/package/``: the package as a whole: API docs,
README, packaging, CLI, assets, benchmarks). Helpers shared by several folders (`batch_rows`,
`step_meter`, `plain_nets`, ...) stay here; every folder is on ``sys.path``, so a test imports a
helper, or another folder's test module, by its name.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from adacc_hf import assets, trace_model
from adacc_hf.policy.builders import random_mix

_HERE = Path(__file__).resolve().parent
for _folder in [_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and p.name[0] != "_")]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

FAMILIES = assets.SUPPORTED_FAMILIES
#: Where the device-aware tests (those using `tiny`, `test_device_exact.py`, the kernel tests) run:
#: ``ADACC_TEST_DEVICE=cuda`` runs them on the GPU (the first GPU check does). There, every test not
#: marked ``fast_kernels`` runs with deterministic algorithms and the math attention backend, so
#: the bitwise claims hold as on CPU (`deterministic_device`).
TEST_DEVICE = torch.device(os.environ.get("ADACC_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda":  # cuBLAS reads it when it starts: deterministic workspaces
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


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


def smollm2_on_text():
    """The shipped pretrained SmolLM2-135M (train mode) and 4 x 128 tokens of Shakespeare;
    skips the test where the asset is missing."""
    try:
        model, tok = assets.load_smollm2()
    except assets.AssetNotFoundError as e:  # pragma: no cover - `make test` installs it
        pytest.skip(str(e))
    model.train()
    train, _ = assets.shakespeare_splits(tok, 128, 4, 0)
    batch = {k: torch.tensor(train[k]) for k in ("input_ids", "attention_mask", "labels")}
    return model, batch


def grad_rel_error(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters together."""
    assert grads.keys() == ref.keys()
    diff = torch.cat([(grads[k] - ref[k]).flatten() for k in ref])
    base = torch.cat([ref[k].flatten() for k in ref])
    return (diff.norm() / base.norm()).item()


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """The HF Trainer registers 8-bit optimizer overrides in bitsandbytes' process-wide manager,
    keyed by ``id(param)``: a later test's parameter that reuses a dead one's id would inherit
    them (fp32 states where 8-bit ones are expected)."""
    yield
    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """A Trainer leaves Accelerate's process-wide state initialized with its mixed precision,
    which `detect_autocast` reads as the autocast of a later test's `prepare` (a bf16 TRL test
    made the automatic micro-batch tests plan under bf16 when they ran after it), and its
    gradient accumulation, which `prepare` reads too (`RunFacts.from_loop`)."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture(scope="module")
def frozen_gc():
    """`activation_memory_report` runs a full `gc.collect()`, which scans every object torch and
    transformers created at import (~0.5 s a call): a module that measures memory many times
    freezes those first (objects created later are collected as usual)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def tiny(family):
    model = assets.tiny_model(family).to(TEST_DEVICE)
    return model, assets.tiny_batch(family, model)


@pytest.fixture(autouse=True)
def deterministic_device(request):
    """On CUDA: deterministic algorithms and the math attention backend (flash and efficient
    attention accumulate their backward with atomics: two equal runs differ), unless the test is
    marked ``fast_kernels`` (it then bounds the error by the device's own run-to-run spread)."""
    if TEST_DEVICE.type != "cuda" or request.node.get_closest_marker("fast_kernels"):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before)


# ---- the families report, rendered into docs/families.md by benchmarks/families_table.py:
#      ADACC_FAMILY_REPORT=path.json pytest tests/adapters/test_families.py
_FAMILY_TESTS = "test_families.py::"
_family_results: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    if _FAMILY_TESTS not in report.nodeid or "[" not in report.nodeid:
        return
    test, family = report.nodeid.split("::")[-1][:-1].split("[", 1)
    entry = _family_results.setdefault(family, {"tests": {}, "seconds": 0.0})
    entry["seconds"] += report.duration
    entry.update(dict(report.user_properties))
    if hasattr(report, "wasxfail"):
        entry["tests"][test] = "xfailed"
        entry["reason"] = report.wasxfail
    elif report.failed:
        entry["tests"][test] = "failed"
    elif report.when == "call" and test not in entry["tests"]:
        entry["tests"][test] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("ADACC_FAMILY_REPORT")
    if not path or not _family_results:
        return
    import json
    import platform

    import transformers

    report = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "families": {k: _family_results[k] for k in sorted(_family_results)},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")


@pytest.fixture
def one_thread():
    """Many small forwards: one thread (with two, a busy 2-core machine makes each ~8x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
