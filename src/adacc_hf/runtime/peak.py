"""The true peak memory of a training step, measured: the ground truth for the step-peak model.

`measure_step_peak(model, batch, optimizer)` runs forward, backward and the optimizer step (one
micro-batch, or several with gradient accumulation) and returns the highest number of bytes alive
on the device at any moment, and per phase:

Every allocation and free the device's allocator reports to ``torch.profiler`` (exact, in time
order, temporaries inside an op included), added to the bytes alive when the step starts:
parameters, buffers, gradients, optimizer state and the batch, each storage once. On CUDA beside
it the highest bytes the caching allocator *reserved* (rounding and segments included -- CUDA runs
out of memory when this does not fit). No allocator statistic is reset.

`AllocationTracker` is the measuring tool on its own: bytes allocated above the level at entry,
at named marks, and the peak between any two marks.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..adapters.base import unwrap_model
from ..adapters.forward import plain_inputs
from ..adapters.plain import registered
from .context import autocast_context

_MARK = "adacc_mark::"


@dataclass
class StepPeak:
    """Measured bytes of one training step on its device (`measure_step_peak`).

    Attributes:
        peak_nbytes: the highest bytes alive at any moment of the step.
        baseline_nbytes: alive when the step started (parameters, buffers, gradients, optimizer
            states, batch).
        phases: the highest bytes alive within each phase (``forward``, ``backward``,
            ``optimizer``).
        device: the device measured.
        how: how it was measured (e.g. ``"cuda allocator events"``).
        reserved_peak_nbytes: CUDA: the caching allocator's highest reserved bytes (None
            elsewhere).
    """

    peak_nbytes: int  # the highest bytes alive at any moment of the step
    baseline_nbytes: int  # alive when the step started (parameters, buffers, grads, states, batch)
    phases: dict[str, int] = field(default_factory=dict)  # highest bytes alive within each phase
    device: str = "cpu"
    how: str = ""
    reserved_peak_nbytes: int | None = None  # CUDA: the allocator's highest reserved bytes


def memory_events(
    results: Any, ours: Callable[[torch.device], bool]
) -> tuple[list[tuple[int, int, int, int]], list[tuple[str, int]]]:
    """The allocator events of a finished ``torch.profiler`` run (``profile_memory=True``) on the
    devices `ours` accepts, and the tracker's marks.

    Returns:
        ``(time ns, address, bytes, reserved bytes)`` in time order (negative bytes: a free; a
        free first among events of the same nanosecond), and ``(mark name, time ns)``.
    """
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int, int]] = []
    marks: list[tuple[str, int]] = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if ours(f.device):
                allocs.append(
                    (node.start_time_ns, int(f.ptr), int(f.alloc_size), int(f.total_reserved))
                )
        elif node.name.startswith(_MARK):
            marks.append((node.name[len(_MARK) :], node.start_time_ns))
    allocs.sort(key=lambda a: (a[0], a[2]))
    marks.sort(key=lambda m: m[1])
    return allocs, marks


class AllocationTracker:
    """Bytes allocated above the level at ``__enter__``: at named marks and between them.

    ``mark(name)`` records a moment (also from inside autograd hooks); after ``__exit__``,
    ``level(name)`` is the level at that mark and ``peak(a, b)`` the highest level between marks
    `a` and `b` (``None``: the start / the end). Every device alike: the allocation events the
    device's allocator reports to ``torch.profiler`` (exact, in time order, temporaries inside an
    op included), replayed; one tracker at a time (torch.profiler does not nest). Nobody's
    statistics are reset: a user's ``torch.cuda.max_memory_allocated`` reads after profiling what
    it would have read without it. On CUDA the allocator's reserved bytes come with each event
    (`reserved_peak_nbytes`); that CUDA reports its events to a CPU-only profiler, and from the
    autograd engine's device thread, is checked on a GPU only (``gpu_suite.py --part budget``).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.peak_nbytes = 0
        self._order: list[str] = []
        self._times: list[int] = []  # event times
        self._levels: list[int] = []  # level after each event
        self._mark_times: dict[str, int] = {}
        self._prof: Any = None
        self.reserved_peak_nbytes: int | None = None  # CUDA: highest reserved bytes

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> AllocationTracker:
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            self.reserved_peak_nbytes = torch.cuda.memory_reserved(self.device)
            self._cuda_max = torch.cuda.max_memory_allocated(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        # Kineto logs every profiler start / stop to stderr; it reads this before its first use
        # (a user's own setting wins).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Record this moment as `name` (the first mark of a name counts)."""
        if name in self._mark_times or name in self._order:
            return
        self._order.append(name)
        with torch.profiler.record_function(_MARK + name):
            pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks ``name`` and ``name:end`` around the block (a phase recurring keeps its max)."""
        self.mark(name)
        try:
            yield
        finally:
            self.mark(name + ":end")

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._replay(self._prof.profiler.kineto_results)
            if self.cuda:
                self._check_cuda()

    def _ours(self, dev: torch.device) -> bool:
        return dev.type == self.device.type and (
            self.device.index is None or dev.index in (None, -1, self.device.index)
        )

    def _replay(self, results: Any) -> None:
        allocs, marks = memory_events(results, self._ours)
        for name, t in marks:
            self._mark_times.setdefault(name, t)
        level = 0
        for t, _, n, reserved in allocs:
            level += n
            self._times.append(t)
            self._levels.append(level)
            if self.reserved_peak_nbytes is not None:
                self.reserved_peak_nbytes = max(self.reserved_peak_nbytes, reserved)
        self.peak_nbytes = max([0, *self._levels])

    def _check_cuda(self) -> None:
        """The allocator's own counters, read (never reset), against the replayed events: the
        level at the end, and a new all-time peak inside the window, must be the events'."""
        end = torch.cuda.memory_allocated(self.device) - self._cuda_start
        new_max = torch.cuda.max_memory_allocated(self.device)
        seen = self._levels[-1] if self._levels else 0
        if seen != end or (
            new_max > self._cuda_max and new_max - self._cuda_start > self.peak_nbytes
        ):
            raise RuntimeError(
                f"adacc: torch.profiler reported {seen} B allocated over the window on "
                f"{self.device} where the allocator counted {end} B (peak "
                f"{self.peak_nbytes} B, allocator's {new_max - self._cuda_start} B): this torch "
                "does not report this device's allocations; please report it"
            )

    # ------------------------------------------------------------------ reading
    def level(self, name: str) -> int:
        """Bytes above the start at mark `name`."""
        i = bisect.bisect_left(self._times, self._mark_times[name])
        return self._levels[i - 1] if i else 0

    def peak(self, start: str | None = None, end: str | None = None) -> int:
        """The highest level between marks `start` and `end` (None: the very start / end)."""
        lo = bisect.bisect_left(self._times, self._mark_times[start]) if start else 0
        hi = bisect.bisect_left(self._times, self._mark_times[end]) if end else len(self._times)
        first = self._levels[lo - 1] if lo else 0
        return max([first, *self._levels[lo:hi]])

    def has(self, name: str) -> bool:
        return name in self._mark_times

    def precedes(self, a: str, b: str) -> bool:
        """Whether mark `a` came before mark `b` (both recorded)."""
        return self._mark_times[a] < self._mark_times[b]


def plain_tensors(t: Any) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: `t` itself, or the inner tensors of a wrapper
    subclass (an FSDP2 DTensor parameter or gradient holds its local shard), recursively. A
    wrapper's own storage is a placeholder whose data pointer cannot be read."""
    if not isinstance(t, torch.Tensor):
        return []
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for name in names for x in plain_tensors(getattr(t, name))]


def unique_storages(tensors: Iterable[Any]) -> Iterator[torch.UntypedStorage]:
    """The non-empty storages holding `tensors` (non-tensors skipped; a wrapper such as an FSDP2
    DTensor by its local shards), each once, in order: tied weights, views and shared
    quantisation maps once."""
    seen: set[tuple[str, int]] = set()
    for t in tensors:
        for x in plain_tensors(t):
            s = x.untyped_storage()
            key = (str(x.device), s.data_ptr())
            if s.nbytes() and key not in seen:
                seen.add(key)
                yield s


def storage_nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages holding `tensors`, each storage once (`unique_storages`)."""
    return sum(s.nbytes() for s in unique_storages(tensors))


def batch_nbytes(tensors: Iterable[Any]) -> int:
    """Bytes a run's own copy of a batch holds: each storage once (``labels`` is often
    ``input_ids`` itself), but only the part its tensors span. A micro-batch sliced out of a
    larger sample (the automatic micro-batch's candidates) is its rows, as the run's collated
    batches are, not the whole sample's storage."""
    spans: dict[tuple[str, int], int] = {}
    for t in tensors:
        for x in plain_tensors(t):
            s = x.untyped_storage()
            key = (str(x.device), s.data_ptr())
            spans[key] = max(spans.get(key, 0), min(s.nbytes(), x.numel() * x.element_size()))
    return sum(spans.values())


def optimizer_tensors(optimizer: Any) -> Iterator[Any]:
    """Every value of ``optimizer.state`` (tensors and scalars alike)."""
    for state in optimizer.state.values():
        yield from state.values() if isinstance(state, dict) else [state]


def _state_tensors(state: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors of a bitsandbytes ``QuantState`` (``absmax``, ``code``, ``offset``) and of
    its nested ``state2`` (double quantisation), read by attribute."""
    if state is None or depth > 2:
        return
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    yield from _state_tensors(getattr(state, "state2", None), depth + 1)


def quantization_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors a quantised weight holds outside the parameter itself, resident all run as the
    parameters are: a bitsandbytes 4-bit weight's quantisation state (per-block absmax, code
    tables, the nested state of double quantisation) and an 8-bit weight's per-row scales
    (``SCB``; ``CB`` is the parameter's own storage). Neither parameters nor buffers, so
    ``model.parameters()`` misses them."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.extend(_state_tensors(getattr(p, "quant_state", None)))
        for name in ("SCB", "CB"):
            t = getattr(p, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def resident_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    tensors: Sequence[Any] = (),
) -> list[Any]:
    """What a training step starts with: parameters, gradients, buffers, quantised weights'
    states (`quantization_tensors`), optimizer state and `tensors` (the batch)."""
    params = list(model.parameters())
    return [
        *params,
        *(p.grad for p in params),
        *model.buffers(),
        *quantization_tensors(model),
        *(optimizer_tensors(optimizer) if optimizer is not None else ()),
        *tensors,
    ]


def live_state_nbytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    tensors: Sequence[Any] = (),
) -> int:
    """Bytes of the storages a training step starts with (`resident_tensors`), each once."""
    return storage_nbytes(resident_tensors(model, optimizer, tensors))


def loss_of(out: Any) -> torch.Tensor:
    """The loss of a model output (``out.loss`` / ``out[0]``)."""
    return out["loss"] if isinstance(out, Mapping) else out[0]


def forward_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The loss of a training forward of `batch`: ``model(**batch)``'s, or for a plain model
    (`adapters.plain`) its forward on the arguments it takes and its ``loss(out, batch)``."""
    base = unwrap_model(model)  # once: what the record is kept by, whose forward is read
    plain = registered(base)
    if plain is None:
        return loss_of(model(**batch))
    return plain.loss_of(model(**plain_inputs(base, batch)), batch)


def measure_step_peak(
    model: nn.Module,
    batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    autocast: torch.dtype | None = None,
) -> StepPeak:
    """Run one training step and measure its peak device memory (see the module docstring).

    `batch` is one micro-batch, or the micro-batches of one optimizer step (gradient accumulation:
    each loss is divided by their number, as the Trainer does). Forward runs under
    ``torch.autocast(dtype=autocast)`` when given (with an empty weight-cast cache, also inside a
    caller's own autocast region: `context.autocast_context`). The outputs are dropped before
    backward except the loss (as ``Trainer.training_step`` does). With `optimizer`, its ``step()`` and
    ``zero_grad(set_to_none=True)`` run last. Without it, the gradients stay in ``.grad``, and a
    step measured beside gradients already there is a later micro-batch's (1x the gradients' bytes
    higher, measured): call ``model.zero_grad(set_to_none=True)`` between such measurements.
    Phases: ``forward``, ``backward``, ``optimizer`` (with several micro-batches: the highest of
    them).

    Args:
        model: the model, patched or not.
        batch: one micro-batch, or the micro-batches of one optimizer step (their forward
            returns the loss: ``out.loss`` / ``out[0]``, a plain model's through its ``loss``).
        optimizer: stepped (and its gradients zeroed) last; None: no optimizer step.
        autocast: the dtype the forward autocasts to (None: none).

    Returns:
        The `StepPeak`: peak and baseline bytes, per phase.

    Raises:
        ValueError: an empty list of micro-batches.
    """
    batches = [batch] if isinstance(batch, Mapping) else list(batch)
    if not batches:
        raise ValueError("measure_step_peak needs at least one batch")
    device = next(model.parameters()).device
    tensors = [v for b in batches for v in b.values() if isinstance(v, torch.Tensor)]
    baseline = live_state_nbytes(model, optimizer, tensors)
    tracker = AllocationTracker(device)
    names: list[tuple[str, str]] = []
    with tracker:
        for i, b in enumerate(batches):
            with tracker.phase(f"forward{i}"), autocast_context(device, autocast):
                loss = forward_loss(model, b)
                if len(batches) > 1:
                    loss = loss / len(batches)
            with tracker.phase(f"backward{i}"):
                loss.backward()
                del loss
            names += [("forward", f"forward{i}"), ("backward", f"backward{i}")]
        if optimizer is not None:
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            names.append(("optimizer", "optimizer"))
    phases: dict[str, int] = {}
    for phase, mark in names:
        phases[phase] = max(phases.get(phase, 0), baseline + tracker.peak(mark, mark + ":end"))
    how = f"{tracker.device.type} allocator events"
    return StepPeak(
        peak_nbytes=baseline + tracker.peak_nbytes,
        baseline_nbytes=baseline,
        phases=phases,
        device=str(device),
        how=how,
        reserved_peak_nbytes=tracker.reserved_peak_nbytes,
    )
