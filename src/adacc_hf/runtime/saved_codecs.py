"""Compression under ``torch.compile``: a compressed op's output, saved for backward, is encoded
in the compiled forward and decoded in the compiled backward.

Selective-checkpoint tags only say save or recompute. A compressed op is tagged ``MUST_SAVE``
and its graph node marked with its codec (`mark`, called by the compile contexts while AOTAutograd
traces), so the partitioner saves it for backward. AOTAutograd inlines saved-tensor hooks that are
``GraphModule``s into the compiled graphs, calling them with the saved node in view
(``_get_saved_tensor_hook_context``). The hooks here encode the marked nodes only (every other
saved tensor passes as it is) with two custom ops, ``adacc::saved_encode`` / ``saved_decode``,
which run the codec as eager does (Triton kernels on CUDA, the torch reference elsewhere): the
same payload bit for bit, so the same decoded values.

Where the codec runs: torch inlines the encode after the forward's last op, so the raw tensor
would live to the end of the forward, and the decode before the backward's first op, so every
decoded tensor would live through the whole backward. `_place` moves each encode right after the
node it encodes and each decode right before its first user in backward: the raw tensor is freed
where an uncompressed plan frees it, the decoded one lives no longer than a retained one.

The hooks must be the innermost saved-tensor hooks whenever dynamo traces and runs the model (it
guards on them). `push` / `pop` install them for an applied policy planned for compile that
compresses (`runtime.apply`) and for compiled profiling runs; outside compiled code they hand every
tensor back unchanged. The compile contexts refuse a compressed op when they are not installed:
it would be saved whole, over the plan.

This relies on private torch API (the hook context, graph-module erase hooks), pinned by tests
on the torch this package pins.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.library import custom_op

from ..codecs import get_codec
from ..codecs.base import Codec, Encoded
from ..schema import Action

logger = logging.getLogger("adacc_hf")

#: The node meta key the compile contexts mark a compressed op's output with (its `spec`).
MARK = "adacc_codec"


def spec(action: Action) -> str:
    """A compressed action's codec as the string the custom ops take."""
    return json.dumps([action.codec, action.codec_kwargs], sort_keys=True)


@functools.lru_cache(maxsize=64)
def _codec(spec: str) -> Codec:
    name, kwargs = json.loads(spec)
    return get_codec(name, **kwargs)


def _flat(enc: Encoded) -> list[torch.Tensor]:
    return [*enc.tensors.values(), *(v for v in enc.meta.values() if torch.is_tensor(v))]


def _encode(x: torch.Tensor, spec: str) -> list[torch.Tensor]:
    return _flat(_codec(spec).encode(x))  # in memory order, as eager encodes it


@custom_op("adacc::saved_encode", mutates_args=())
def saved_encode(x: torch.Tensor, spec: str) -> list[torch.Tensor]:
    """The payload tensors of `x` encoded with codec `spec` (`Encoded.tensors`, then the tensors
    of its meta)."""
    return _encode(x, spec)


@saved_encode.register_fake
def _(x: torch.Tensor, spec: str) -> list[torch.Tensor]:
    return _encode(x, spec)  # payload sizes never depend on the data


@functools.lru_cache(maxsize=256)
def _template(
    spec: str, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> Encoded:
    """An encoding of this layout on the meta device: the payload's names, python meta and the
    memory order it describes."""
    return _codec(spec).encode(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))


@custom_op("adacc::saved_decode", mutates_args=())
def saved_decode(
    payload: list[torch.Tensor],
    spec: str,
    shape: list[int],
    stride: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The tensor `saved_encode` encoded, with the saved tensor's shape, strides and dtype (a
    dense tensor with permuted leading dims comes back as a view in its layout, as eager's
    decode returns it; any other layout is copied into it)."""
    t = _template(spec, tuple(shape), tuple(stride), dtype)
    n = len(t.tensors)
    meta = dict(t.meta)
    meta.update(zip([k for k, v in t.meta.items() if torch.is_tensor(v)], payload[n:], strict=True))
    tensors = dict(zip(t.tensors, payload[:n], strict=True))
    y = _codec(spec).decode(Encoded(t.codec, t.shape, dtype, tensors, meta, t.order))
    if tuple(y.stride()) == tuple(stride):
        return y
    return torch.empty_strided(shape, stride, dtype=dtype, device=y.device).copy_(y)


@saved_decode.register_fake
def _(payload, spec, shape, stride, dtype):
    return torch.empty_strided(shape, stride, dtype=dtype, device=payload[0].device)


def mark(op: Any, codec_spec: str) -> None:
    """Mark the graph node AOTAutograd just traced for `op` with its codec (no-op when no graph
    is being traced, e.g. dynamo's own pass)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return
    for node in reversed(mode.tracer.graph.nodes):
        if node.target is op:
            node.meta[MARK] = codec_spec
            return


def _saved() -> tuple[Any, Any, str | None]:
    """(hook context, saved node, its codec spec) while AOTAutograd inlines a hook, else Nones."""
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    ctx = _get_saved_tensor_hook_context()
    node = ctx.get("_node") if ctx else None
    return ctx, node, node.meta.get(MARK) if node is not None else None


def _pack(self: Any, x: Any) -> Any:
    ctx, node, codec_spec = _saved()
    if node is not None:
        _match_rng_state(ctx, node)
    if codec_spec is None:
        return x
    return tuple(torch.ops.adacc.saved_encode(x, codec_spec))


def _unpack(self: Any, packed: Any) -> Any:
    ctx, node, codec_spec = _saved()
    if codec_spec is None:
        return packed
    _place(ctx, node)
    val = node.meta["val"]
    return torch.ops.adacc.saved_decode(
        list(packed), codec_spec, list(val.shape), list(val.stride()), val.dtype
    )


def _is_rng_state(node: Any) -> bool:
    from torch._prims.rng_prims import run_and_save_rng_state

    return (
        isinstance(node, torch.fx.Node)
        and node.target is operator.getitem
        and node.args[1] == 0
        and getattr(node.args[0], "target", None) is run_and_save_rng_state
    )


def _match_rng_state(ctx: dict[str, Any], saved: torch.fx.Node) -> None:
    """Give a saved generator state its backward name. The partitioner saves the state of each
    random op it replays as a forward output named after its node (``getitem_6``) but a backward
    input named ``rng_state_output_<i>``; torch's inlining looks the input up by the forward name
    and fails. The i-th state output of the forward is the i-th such input of the backward."""
    if not _is_rng_state(saved):
        return
    fw = ctx["_fw_graph"].owning_module
    names = fw.__dict__.get("_adacc_rng_names")
    if names is None:
        states = [n.name for n in fw.graph.output_node().args[0] if _is_rng_state(n)]
        inputs = [
            n.name
            for n in ctx["_bw_graph"].find_nodes(op="placeholder")
            if n.name.startswith("rng_state_output_")
        ]
        names = fw.__dict__["_adacc_rng_names"] = dict(zip(states, inputs, strict=True))
    name = names.pop(saved.name, None)
    if name is not None:
        saved._rename(name)
    if not names:  # every state renamed: nothing left on the module (inductor pickles it)
        del fw.__dict__["_adacc_rng_names"]


def _place(ctx: dict[str, Any], saved: torch.fx.Node) -> None:
    """Move `saved`'s encode (just inlined at the forward's end) right after it, and have its
    decode (inlined next at the backward's start) moved before its first user once torch has
    rewired the backward (when it erases the saved tensor's placeholder)."""
    for enc in list(saved.users):
        if enc.target is torch.ops.adacc.saved_encode.default:
            saved.append(enc)
            for item in reversed(list(enc.users)):
                enc.append(item)
    bw = ctx["_bw_graph"].owning_module

    def sink(erased: torch.fx.Node) -> None:
        if erased.op == "placeholder" and erased.name == saved.name:
            bw._erase_node_hooks.remove(sink)  # nothing left on the module (inductor pickles it)
            _sink_decode(erased)

    bw._register_erase_node_hook(sink)


def _sink_decode(erased: torch.fx.Node) -> None:
    """Move the decode that replaced placeholder `erased` before its first user."""
    prefix = erased.name + "_hook_"
    graph = erased.graph
    for node in graph.nodes:
        if node.target is torch.ops.adacc.saved_decode.default and any(
            a.name.startswith(prefix) for a in node.args[0]
        ):
            users = [u for u in node.users if u.op != "output"]
            if users:
                pos = {n: i for i, n in enumerate(graph.nodes)}
                min(users, key=pos.__getitem__).prepend(node)
            return


class _Hook(torch.fx.GraphModule):
    """A saved-tensor hook AOTAutograd inlines (it must be a ``GraphModule``); its forward is a
    python function, traced when inlined (every ``GraphModule`` instance has its own class)."""

    def __init__(self, body: Any) -> None:
        super().__init__(torch.nn.Module(), torch.fx.Graph())
        type(self).forward = body


@functools.cache
def hooks() -> tuple[_Hook, _Hook]:
    return _Hook(_pack), _Hook(_unpack)


_PUSHED = threading.local()


def installed() -> bool:
    """Whether this thread pushed the hooks and has not popped them (inside a checkpointed
    region, torch's own checkpoint hooks sit above them while a block is traced)."""
    return getattr(_PUSHED, "depth", 0) > 0


def _on_top() -> bool:
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and top[0] is hooks()[0]


def push() -> None:
    torch._C._autograd._push_saved_tensors_default_hooks(*hooks())
    _PUSHED.depth = getattr(_PUSHED, "depth", 0) + 1


def pop() -> None:
    """Remove the hooks `push` installed (left in place, with a warning, under other hooks
    pushed after them and not removed: they pass tensors through)."""
    if not installed():
        return
    _PUSHED.depth -= 1
    if _on_top():
        torch._C._autograd._pop_saved_tensors_default_hooks()
    else:
        logger.warning(
            "adacc: other saved-tensor hooks were installed after adacc's compiled-codec hooks "
            "and not removed: adacc's stay installed below them (they pass tensors through)"
        )


@contextmanager
def active() -> Iterator[None]:
    push()
    try:
        yield
    finally:
        pop()
