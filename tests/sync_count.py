"""Counting host syncs: aten ops that make the host wait for the device.

`SyncCounter` is a TorchDispatchMode that tallies every op that reads device data on the host
(``_local_scalar_dense`` behind ``.item()`` / ``bool()`` / ``int()``, ``is_nonzero``, ``equal``,
``allclose``), every op whose output size depends on the data (``nonzero``, ``masked_select``,
``unique``, boolean indexing, ``repeat_interleave`` without ``output_size``), and device-to-host
copies. ``Tensor.tolist()`` on a CPU tensor is invisible to dispatch modes (on CUDA it shows as a
device-to-host copy); the library's hot path never calls it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_READS = {
    "_local_scalar_dense",
    "is_nonzero",
    "item",
    "equal",
    "allclose",
    "nonzero",
    "nonzero_numpy",
    "argwhere",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "_assert_scalar",
}
_BOOL_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _is_sync(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in _READS:
        return True
    leaves = tree_flatten((args, kwargs))[0]
    if name in _BOOL_INDEX:
        return any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
            for t in tree_flatten(args[1])[0]
        )
    if name == "repeat_interleave":
        return not (kwargs or {}).get("output_size") and any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64) for t in leaves
        )
    if name in ("_to_copy", "copy_", "to"):
        src = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
        dst = kwargs.get("device") if kwargs else None
        if name == "copy_":
            src, dst = args[1], args[0].device
        return (
            src is not None
            and src.device.type != "cpu"
            and dst is not None
            and torch.device(dst).type == "cpu"
        )
    return False


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.total`` / ``c.ops`` (a Counter by op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_sync(func, args, kwargs or {}):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())
