"""Device tables: what a GPU measured, committed, for pricing work on it without it.

A table (``tables/<name>.json``, written by ``benchmarks/device_table.py`` from the GPU runs in
``benchmarks/results/``) holds the device's measured copy bandwidth at four sizes, its host link,
each codec backend's measured encode / decode times at four sizes, its datasheet matmul
throughput, and the efficiencies `calibrate` fitted on committed step times (of this device, or,
to check the model, of another). Times between measured sizes are interpolated linearly in bytes;
below the smallest size the smallest size's time holds (a launch costs that much anyway), above
the largest they grow at the last segment's slope.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

__all__ = ["DEFAULT_EFFICIENCY", "DeviceTable", "known_devices", "load_device"]

MB = 2**20

#: Starting point of a calibration and what an uncalibrated table uses.
DEFAULT_EFFICIENCY: dict[str, float] = {
    "matmul": 0.7,  # of the datasheet's dense matmul throughput
    # fused attention, of the same: FlashAttention-2 (torch's SDPA kernel) reaches about 35 % of
    # an H100's peak (the FlashAttention-3 paper, Shah et al. 2024, section 1)
    "attention": 0.35,
    "memory": 0.85,  # of the measured copy bandwidth at the largest size
    "launch_us": 4.0,  # a kernel's fixed cost
    "host_op_us": 8.0,  # the host's cost of issuing one op
    # more per crossing of a runtime dispatch mode: 27.9 us per op crossing them twice (forward
    # and replay) on this project's CPU (`benchmarks/results/dispatch-cpu.json`, wall clock)
    "host_mode_us": 14.0,
}


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x): flat below, last slope above."""
    xs = [p[0] for p in points]
    if x <= xs[0] or len(points) == 1:
        return points[0][1]
    i = min(bisect.bisect_left(xs, x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class DeviceTable:
    """One device's measured figures and calibrated efficiencies (module docstring)."""

    name: str  # "h200"
    label: str  # "NVIDIA H200"
    memory_gib: float
    matmul_tflops: float  # dense bf16, the datasheet's
    copy_gbps: dict[str, float]  # size in MB -> GB/s (read + write counted)
    link: dict[str, Any] = field(default_factory=dict)  # d2h_gbps, h2d_gbps, launch_ms
    # codec -> backend -> size in MB -> [encode_ms, decode_ms] (bf16 inputs, 4096 channels)
    codecs: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    calibrated_on: list[str] = field(default_factory=list)  # the committed runs fitted
    # what a fit is held near: `DEFAULT_EFFICIENCY`, or what the device itself measured (the
    # codecs check's ``device`` section: its matmul, attention and host costs)
    prior: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    sources: list[str] = field(default_factory=list)  # the results files read

    @property
    def copy_peak_gbps(self) -> float:
        return max(self.copy_gbps.values())

    def copy_gbps_at(self, nbytes: float) -> float:
        """Copy bandwidth at `nbytes` (interpolated in time over the measured sizes)."""
        pts = sorted((float(mb) * MB, 2 * float(mb) * MB / g) for mb, g in self.copy_gbps.items())
        seconds = _interp([(x, y / 1e9) for x, y in pts], float(nbytes))
        return 2 * nbytes / seconds / 1e9 if nbytes > 0 else self.copy_peak_gbps

    def codec_ms(self, codec: str, backend: str, nbytes: int) -> tuple[float, float] | None:
        """(encode, decode) ms of `codec` on `backend` for a `nbytes` input (None: unmeasured)."""
        rows = self.codecs.get(codec, {}).get(backend)
        if not rows:
            return None
        pts = sorted((float(mb) * MB, v) for mb, v in rows.items())
        enc = _interp([(x, v[0]) for x, v in pts], float(nbytes))
        dec = _interp([(x, v[1]) for x, v in pts], float(nbytes))
        return enc, dec

    def with_efficiency(self, efficiency: dict[str, float], on: list[str]) -> DeviceTable:
        """This table with other efficiencies (fitted on the runs `on`)."""
        d = asdict(self)
        d.update(efficiency=dict(efficiency), calibrated_on=list(on))
        return DeviceTable(**d)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceTable:
        d = json.loads(text)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def known_devices() -> list[str]:
    """Names of the committed tables (``h100``, ``h200``)."""
    files = resources.files(__package__).joinpath("tables")
    return sorted(p.name.removesuffix(".json") for p in files.iterdir() if p.name.endswith(".json"))


def load_device(name: str) -> DeviceTable:
    """The committed table `name` (see `known_devices`)."""
    from ..errors import AdaccError

    key = name.lower().removeprefix("nvidia-").removeprefix("nvidia ")
    path = resources.files(__package__).joinpath("tables", f"{key}.json")
    if not path.is_file():
        raise AdaccError(
            f"no device table {name!r}; known: {', '.join(known_devices())} (a table is built "
            "from a GPU's committed runs by benchmarks/device_table.py)"
        )
    return DeviceTable.from_json(path.read_text())
