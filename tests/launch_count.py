"""Counting what one codec call launches: Triton kernels and dispatched aten ops.

`LaunchCounter` patches the ``run`` method of Triton's kernel objects (``JITFunction`` when
compiled, ``InterpretedFunction`` under ``TRITON_INTERPRET=1``), through which every
``kernel[grid](...)`` goes, and records each aten op that reaches the dispatcher
(a TorchDispatchMode: allocations and views included, each by its overload packet name; the
interpreter's own host copies inside a launch are not counted).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Aten ops that allocate or view without touching memory: no device kernel behind them.
NO_KERNEL = {
    "empty",
    "empty_strided",
    "new_empty",
    "view",
    "_reshape_alias",
    "reshape",
    "as_strided",
    "select",
    "slice",
    "detach",
    "alias",
}


def _kernel_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover (older triton)
        return classes
    return [*classes, InterpretedFunction]


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...`` then ``c.launches`` (kernel names) and ``c.aten``."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self.aten: Counter[str] = Counter()
        self._saved: list[tuple[type, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def device_ops(self) -> Counter[str]:
        """The aten ops that run a device kernel (not allocations or views)."""
        return Counter({k: v for k, v in self.aten.items() if k not in NO_KERNEL})

    def __enter__(self) -> LaunchCounter:
        for cls in _kernel_classes():
            original = cls.run
            self._saved.append((cls, original))

            def run(kernel, *args, _original=original, **kwargs):
                if not kwargs.get("warmup"):
                    self.launches.append(kernel.__name__)
                # the interpreter's own copies to and from the host are not the codec's ops
                with _disable_current_modes():
                    return _original(kernel, *args, **kwargs)

            cls.run = run
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for cls, original in self._saved:
            cls.run = original
        self._saved.clear()
