"""What the profiler measures and the solver reads: codec, op, group and model profiles, and the
full-recomputation step timeline (no torch import)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import PolicyError
from .ops import ALWAYS_RETAIN, PROFILE_FORMAT, Action, OpSpec


# ----------------------------------------------------------------------------------- profiles
@dataclass
class CodecProfile:
    """One codec measured on one op's real output."""

    codec: str
    params: dict[str, Any]
    nbytes: int  # encoded bytes (exact, on the profiled activation)
    encode_ms: float
    decode_ms: float
    rel_error: float  # error on what backward reads (see codecs.relative_error)
    n_outliers: int = 0
    encode_workspace_nbytes: int = 0  # peak temporaries of one encode, beyond the payload
    decode_workspace_nbytes: int = 0  # peak temporaries of one decode, beyond its output
    # relative error of the profiled block's gradients with only this op compressed
    # (`profiler.fidelity`); None: not measured
    grad_error: float | None = None
    # the implementation the times are of, the fastest measured on the device
    # (`codecs.backends`; "": the kernel mode's choice, the only one measured)
    backend: str = ""
    # every backend measured: name -> [encode_ms, decode_ms]
    backend_ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return self.encode_ms + self.decode_ms

    def action(self, kind: str = "compress") -> Action:
        """The action that runs this codec as measured (its parameters and backend)."""
        make = Action.compress if kind == "compress" else Action.offload
        return make(self.codec, self.backend or None, **self.params)


@dataclass(frozen=True)
class OpProfile(OpSpec):
    """One op of a block with its measured costs."""

    fwd_ms: float = 0.0  # time to (re)compute it
    block_output: bool = False  # an output of this op is the block's output
    codecs: dict[str, CodecProfile] = field(default_factory=dict)
    shared_nbytes: int = 0  # bytes of its outputs held anyway (by the next block, as its input)
    # kept (retained or compressed) by a checkpointed block, the generator state it holds for
    # replay beside its output (a random op on a CPU device: `runtime.kept.generator_state_nbytes`)
    rng_nbytes: int = 0

    @property
    def retain_nbytes(self) -> int:
        return self.nbytes - self.shared_nbytes

    def spec(self) -> OpSpec:
        """The op as a policy names it (no measurements)."""
        return OpSpec(**{f.name: getattr(self, f.name) for f in fields(OpSpec)})

    @classmethod
    def from_spec(cls, spec: OpSpec, **measured: Any) -> OpProfile:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(OpSpec)}, **measured)


def codec_can_pay(op: OpProfile, codec: CodecProfile) -> bool:
    """Whether some encoded size and error of `codec` could make the solver compress `op`: the op
    is a policy op that may be compressed, and the codec is faster than recomputing it (otherwise
    recompute, holding nothing and costing no more, beats it whatever it encodes to:
    `solver.cost_model.choices_for` drops it)."""
    return op.cacheable and op.layer_type not in ALWAYS_RETAIN and codec.ms < op.fwd_ms


@dataclass
class GroupProfile:
    """A block group: its ops and what a block costs as a whole (bytes per block)."""

    name: str
    num_blocks: int
    input_nbytes: int  # held by a checkpointed block whatever the policy (measured)
    full_nbytes: int  # held by a block with no checkpointing (measured)
    fixed_ms: float  # recompute time of ops that always rerun in a checkpointed block
    transient_nbytes: int  # peak of a checkpointed block's backward above the level at its start
    block_fwd_ms: float  # one block's forward, no checkpointing
    ops: list[OpProfile] = field(default_factory=list)
    plain_transient_nbytes: int = 0  # the same for a block without checkpointing
    output_nbytes: int = 0  # a block's output (the gradient its backward starts from)
    grad_nbytes: int = 0  # gradients of one block's trainable parameters (unsharded)
    positions: list[int] = field(default_factory=list)  # each block's index in forward order
    forward_transient_nbytes: int = 0  # peak of a checkpointed block's forward above its start
    plain_forward_transient_nbytes: int = 0  # the same for a block without checkpointing
    full_interior_nbytes: int = 0  # held by a plain block followed by a plain one (0: unknown)
    # held by a checkpointed block's checkpoint besides the tensors it saves: the generator state
    # stashed to replay dropout (host memory: counted on a CPU device; `runtime.checkpoint`)
    frame_nbytes: int = 0
    # Of a plain block's bytes, autocast's parameter casts: alive in the weight-cast cache through
    # forward under any policy, so they add to the step only from backward on.
    plain_cast_nbytes: int = 0
    # runtime overhead of a checkpointed block that caches any op: every aten op of its forward
    # and recompute crossing the runtime's dispatch modes (measured; 0 in older profiles)
    dispatch_ms: float = 0.0
    # the profiled block's forward + backward under four action tables and the scales the op
    # times got from them (`profiler.calibrate.Calibration`; empty in older or sharded profiles)
    calibration: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timeline:
    """One training step measured under full recomputation at the profiled shape: bytes above the
    level when the step starts (activations, gradients, temporaries; parameters, buffers and
    optimizer states excluded), at the moments where memory can peak. Lists are per block in
    forward order."""

    held: list[int]  # what each block's forward leaves held for backward
    forward_start: list[int]  # when block j's forward starts
    forward_peak: list[int]  # the highest during block j's forward
    backward_start: list[int]  # when block j's backward starts (its output's gradient arrived)
    backward_peak: list[int]  # the highest during block j's backward (its recompute included)
    loss_peak: int = 0  # the highest after the last block's forward (final norm, head, loss)
    head_peak: int = 0  # the highest from backward's start to the last block's backward
    tail_peak: int = 0  # the highest after the first block's backward (embeddings)
    grads: list[int] = field(default_factory=list)  # gradient bytes alive at backward_start
    # The highest between block j's forward end and block j+1's start (T5: the encoder's final
    # norm and the decoder's embeddings; at least the level when block j ends), and between block
    # j+1's backward end and block j's start (0 where block j's starts first: consecutive blocks of
    # one stack, whose hooks sit on one tensor). Empty in profiles from before they were measured.
    forward_gap: list[int] = field(default_factory=list)
    backward_gap: list[int] = field(default_factory=list)


@dataclass
class HeadCost:
    """One way of running the LM head and loss (`HEADS`), measured alone on the profiled batch:
    bytes above the level when it starts (the final hidden states alive), and its time."""

    held: int  # left held for backward at the end of forward (log-probs, saved inputs)
    forward_peak: int  # the highest during its forward
    backward_peak: int  # the highest during its backward (the held bytes included)
    ms: float  # forward + backward


@dataclass
class OffloadLink:
    """The link offloaded tensors cross between device and host memory (`runtime.offload`):
    measured once by the profiler (pinned copies each way) or given.

    ``overlap``: copies run on a side stream beside the blocks' compute (CUDA), so a block's
    copies cost time only where they outlast its forward (device to host) or its backward (host
    to device back); else (the CPU stand-in) they run in line and cost all their time.
    ``host_cap_nbytes``: the host memory offload may hold (0: no cap)."""

    d2h_gbps: float  # device -> host, 1e9 bytes per second
    h2d_gbps: float  # host -> device
    overlap: bool
    launch_ms: float = 0.0  # each copy's fixed cost (its launch and events)
    host_cap_nbytes: int = 0

    def d2h_ms(self, nbytes: int | float) -> float:
        return nbytes / (self.d2h_gbps * 1e6)

    def h2d_ms(self, nbytes: int | float) -> float:
        return nbytes / (self.h2d_gbps * 1e6)


@dataclass
class Profile:
    """Everything the solver needs, measured on one device, dtype and micro-batch shape.

    Made by `profile_model`; saved and read as JSON (``to_json`` / ``from_json``). The step's
    memory outside the blocks: ``nonblock_nbytes`` held for backward (of it,
    ``nonblock_before_nbytes`` created before the first block: embeddings, masks; the rest after:
    final norm, logits, loss), the forward's own temporaries above what it leaves held, and the
    backward's transients: from the loss to the last block (``head``: logits gradient, head weight
    gradient) and after the first block (``tail``: embedding gradients, tied weights).

    Attributes:
        model_type: the model's type (``config.model_type``).
        adapter: the adapter that found its blocks.
        adapter_version: that adapter's version.
        device: the device measured on (with its name on CUDA).
        dtype: the model's floating-point parameter dtype.
        batch_shape: the micro-batch's tensor shapes, by name.
        groups: per block group, its ops' costs and its blocks' memory (`GroupProfile`).
        nonblock_nbytes: bytes held for backward outside the blocks.
        head_transient_nbytes: the backward's transient from the loss to the last block (logits
            gradient, head weight gradient).
        profile_ms: wall time spent profiling.
        phase_ms: of it, per `profiler.phases` phase.
        autocast: the autocast dtype the profile ran under (None: off).
        nonblock_before_nbytes: of ``nonblock_nbytes``, what was created before the first block.
        forward_transient_nbytes: the forward's own temporaries above what it leaves held.
        tail_transient_nbytes: the backward's transient after the first block (embedding
            gradients, tied weights).
        nonblock_grad_nbytes: gradients of trainable parameters outside the blocks.
        batch_nbytes: the micro-batch's own tensors (on the device all step long).
        timeline: one step measured under full recomputation (None: synthesised from the fields
            above).
        variant_transients: measured per action table: ``"group:variant fingerprint"`` ->
            [forward, backward] transient minus full recomputation's, on the profiled block
            (``"group:full"``: full recomputation's own); measured compiled, a third entry: the
            held bytes minus full recomputation's.
        variant_ms: measured per action table (same keys): forward + backward ms of the
            profiled block under it minus the plain block's.
        heads: measured per way of running the LM head and loss (`HEADS`; empty: only the
            model's own, which the timeline measured).
        compiled: where the blocks were measured under ``torch.compile`` too
            (`profiler.compiled`): the backend and, per group, the shifts (compiled - eager) the
            profile was moved by; empty: eager.
        library_version: the adacc-hf version that measured it.
        fingerprint: what the measurements depend on besides the batch (`profiler.fingerprint`),
            and the bucket.
        memory_from: the two buckets this profile's memory was interpolated between
            (`profiler.derive`), tiny first; empty: measured.
        offload: the device <-> host link, where offload is planned (None: the solver never
            offloads).
        format_version: the profile's file format.
    """

    model_type: str
    adapter: str
    adapter_version: int
    device: str
    dtype: str
    batch_shape: dict[str, list[int]]
    groups: dict[str, GroupProfile]
    nonblock_nbytes: int
    head_transient_nbytes: int = 0
    profile_ms: float = 0.0  # wall time spent profiling
    phase_ms: dict[str, float] = field(default_factory=dict)  # of it, per `profiler.phases` phase
    autocast: str | None = None  # the autocast dtype the profile ran under (None: off)
    nonblock_before_nbytes: int = 0
    forward_transient_nbytes: int = 0
    tail_transient_nbytes: int = 0
    nonblock_grad_nbytes: int = 0  # gradients of trainable parameters outside the blocks
    batch_nbytes: int = 0  # the micro-batch's own tensors (on the device all step long)
    timeline: Timeline | None = None  # measured; None: synthesised from the fields above
    # Measured per action table: "group:variant fingerprint" -> [forward, backward] transient
    # minus full recomputation's, on the profiled block ("group:full": full recomputation's own);
    # measured compiled, a third entry: the held bytes minus full recomputation's.
    variant_transients: dict[str, list[int]] = field(default_factory=dict)
    # Measured per action table (same keys): forward + backward ms of the profiled block under it
    # minus the plain block's (`profiler.variants.variant_times`).
    variant_ms: dict[str, float] = field(default_factory=dict)
    # Measured per way of running the LM head and loss (`HEADS`; empty: only the model's own,
    # which the timeline measured).
    heads: dict[str, HeadCost] = field(default_factory=dict)
    # Where the blocks were measured under torch.compile too (`profiler.compiled`): the backend
    # and, per group, the shifts (compiled - eager) the profile was moved by; empty: eager.
    compiled: dict[str, Any] = field(default_factory=dict)
    library_version: str = ""
    # what the measurements depend on besides the batch (`profiler.fingerprint`), and the bucket
    fingerprint: dict[str, str] = field(default_factory=dict)
    # the two buckets this profile's memory was interpolated between (`profiler.derive`), tiny
    # first; empty: measured
    memory_from: list[str] = field(default_factory=list)
    # the device <-> host link, where offload is planned (None: the solver never offloads)
    offload: OffloadLink | None = None
    format_version: int = PROFILE_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        version = d.get("format_version", 1)
        if not isinstance(version, int) or version > PROFILE_FORMAT:
            raise PolicyError(
                f"profile format {version!r} was written by a newer adacc-hf: upgrade it, or "
                "profile again"
            )
        known_profile = {f.name for f in fields(cls)}
        known_group = {f.name for f in fields(GroupProfile)}
        known_op = {f.name for f in fields(OpProfile)}
        groups = {}
        for name, g in d.pop("groups").items():
            ops = []
            for o in g.pop("ops"):
                codecs = {k: CodecProfile(**c) for k, c in o.pop("codecs").items()}
                o = {k: v for k, v in o.items() if k in known_op}
                ops.append(OpProfile(**{**o, "shape": tuple(o["shape"])}, codecs=codecs))
            g = {k: v for k, v in g.items() if k in known_group}
            groups[name] = GroupProfile(**g, ops=ops)
        if "nonblock_transient_nbytes" in d:  # format 1
            d.setdefault("head_transient_nbytes", d.pop("nonblock_transient_nbytes"))
        d = {k: v for k, v in d.items() if k in known_profile}
        if isinstance(d.get("timeline"), dict):
            d["timeline"] = Timeline(**d["timeline"])
        d["heads"] = {k: HeadCost(**v) for k, v in d.get("heads", {}).items()}
        if isinstance(d.get("offload"), dict):
            d["offload"] = OffloadLink(**d["offload"])
        return cls(**d, groups=groups)

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups.values())

    def no_checkpoint_nbytes(self) -> int:
        """Activation bytes held with no checkpointing anywhere."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.full_nbytes for g in self.groups.values()
        )

    @property
    def nonblock_after_nbytes(self) -> int:
        return self.nonblock_nbytes - self.nonblock_before_nbytes

    def block_order(self) -> list[tuple[str, int]]:
        """(group, index within the group) of every block, in forward order."""
        order = []
        for name, g in self.groups.items():
            positions = g.positions or [None] * g.num_blocks
            for i, pos in enumerate(positions):
                order.append((pos if pos is not None else len(order), name, i))
        return [(name, i) for _, name, i in sorted(order)]

    def full_recompute_nbytes(self) -> int:
        """Activation bytes held under full recomputation."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.input_nbytes for g in self.groups.values()
        )
