"""Device specifications: what an analytic op time needs to know about a device you may not have.

A spec is a small JSON file (``memplan.planner.core.device_specs/*.json`` ships A100-80GB, H100-80GB, L4 and
RTX 4090; any file of the same shape works)::

    {"name": "h100-80gb", "device": "cuda", "memory_bytes": 85899345920,
     "peak_flops_per_s": {"float32": 67e12, "bfloat16": 989.4e12, ...},
     "memory_bandwidth_bytes_per_s": 3.35e12, "host_bandwidth_bytes_per_s": 50e9, "op_overhead_s": 4e-6}

A peak is what no training step reaches: dense matrix products get a fraction of it, attention and
elementwise kernels less, and memory-bound ops a fraction of the bandwidth. So a spec may carry what each
class of op (:mod:`memplan.planner.core.opclass`: matmul, attention, convolution, normalization,
reduction, elementwise, copy) *achieves*, each entry with the source of its figures::

    "achieved": {"matmul": {"flops_per_s": {"float32": 51.88e12, ...}, "source": "..."},
                 "copy": {"bytes_per_s": 2.49e12, "source": "..."}}

An op's analytic time is the roofline ``op_overhead_s + max(flops / FLOP/s, bytes_moved / bytes/s)`` with
the rates of its class (:meth:`DeviceSpec.rates`): the class's own figure, else that of the class it
falls back to (:data:`CLASS_FALLBACK`: attention and convolution to matmul, normalization to reduction
to elementwise to copy), else the peak FLOP/s and the copy class's bandwidth or the peak bandwidth
(:mod:`memplan.planner.probe.optime`). Torch-free: pydantic only.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.files import parse_json_object, read_file_bytes
from memplan.planner.core.opclass import OpClass

PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# The CUDA caching allocator rounds every block up to a multiple of 512 bytes (kMinBlockSize), and
# torch.cuda.memory_allocated counts the rounded size.
CUDA_BLOCK_BYTES = 512
PEAK_MARGIN = 1.25  # how far above a listed peak an achieved figure may be (boost clocks) before it is refused


class DeviceSpecError(MemplanError):
    """A ``--device-spec`` that is neither a shipped name nor a valid spec file."""


# Where a class with no figure of its own (for the dtype asked) takes it from; None: the spec's peak FLOP/s
# and memory bandwidth. Attention and convolution kernels are matrix products at heart; normalizations
# and reductions stream their inputs as elementwise kernels do, and those stream like copies.
CLASS_FALLBACK: dict[str, str | None] = {"matmul": None, "attention": "matmul", "convolution": "matmul",
                                         "normalization": "reduction", "reduction": "elementwise",
                                         "elementwise": "copy", "copy": None}


class Achieved(BaseModel):
    """What one class of op achieves on the device, and where the figures come from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flops_per_s: dict[str, PositiveRate] = Field(default_factory=dict,
                                                 description="achieved FLOP/s per dtype name")
    bytes_per_s: PositiveRate | None = Field(default=None, description="achieved bytes read + written per second")
    source: str = Field(min_length=1, description="where the figures come from (a citation or a measurement)")

    @model_validator(mode="after")
    def _has_a_figure(self) -> Achieved:
        if not self.flops_per_s and self.bytes_per_s is None:
            raise ValueError("gives neither flops_per_s nor bytes_per_s")
        return self


class DeviceSpec(BaseModel):
    """One device's figures for analytic op times and memory rounding. Rates are per second."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    device: Literal["cuda", "cpu"] = Field(description="the torch device type a graph for it carries")
    memory_bytes: int = Field(gt=0, description="device memory")
    peak_flops_per_s: dict[str, PositiveRate] = Field(
        min_length=1, description="dense peak per dtype name (float32, bfloat16, float16, ...)")
    memory_bandwidth_bytes_per_s: PositiveRate
    host_bandwidth_bytes_per_s: PositiveRate = Field(description="device <-> pinned host copies (offload)")
    host_optimizer_bytes_per_s: PositiveRate | None = Field(
        default=None, description="parameter bytes per second the machine's host steps with the profiled optimizer "
                                  "(host-stepped model states); None: measured on the profiling machine")
    host_source: str = Field(default="", description="where host_optimizer_bytes_per_s comes from (required with it)")
    op_overhead_s: float = Field(default=5e-6, ge=0, allow_inf_nan=False,
                                 description="fixed cost of launching one op")
    workspace_bytes: int = Field(
        default=0, ge=0, le=2**50,
        description="device memory a training step's libraries hold that no tensor owns (cuBLAS workspaces: "
                    "one per handle and stream, for forward's thread and autograd's device thread)")
    achieved: dict[OpClass, Achieved] = Field(
        default_factory=dict, description="achievable throughput per op class (opclass.OP_CLASSES), with sources")

    @model_validator(mode="after")
    def _host_figure_has_a_source(self) -> DeviceSpec:
        if self.host_optimizer_bytes_per_s is not None and not self.host_source.strip():
            raise ValueError("host_optimizer_bytes_per_s needs host_source: where the figure comes from")
        return self

    @model_validator(mode="after")
    def _achieved_within_peak(self) -> DeviceSpec:
        """An achieved figure well above the peak it is a fraction of is a unit or copying mistake. Boost
        clocks run past a datasheet's (an RTX 4090 measured 168 TFLOP/s in float16 against 165 listed),
        hence the margin."""
        for name, entry in self.achieved.items():
            for dtype, rate in entry.flops_per_s.items():
                peak = self.peak_flops_per_s.get(dtype)
                if peak is not None and rate > PEAK_MARGIN * peak:
                    raise ValueError(f"achieved.{name}.flops_per_s.{dtype}: {rate:.4g} is above the peak {peak:.4g}")
            if entry.bytes_per_s is not None and entry.bytes_per_s > PEAK_MARGIN * self.memory_bandwidth_bytes_per_s:
                raise ValueError(f"achieved.{name}.bytes_per_s: {entry.bytes_per_s:.4g} is above the memory "
                                 f"bandwidth {self.memory_bandwidth_bytes_per_s:.4g}")
        return self

    def flops_per_s(self, dtype: str) -> float:
        """The peak for ``dtype`` ("float32", ...); float32's when the spec has none for it (integer ops)."""
        return self.peak_flops_per_s.get(dtype) or self.peak_flops_per_s.get("float32") or \
            min(self.peak_flops_per_s.values())

    def rates(self, op_class: str, dtype: str) -> tuple[float, float]:
        """``(FLOP/s, bytes/s)`` an op of ``op_class`` in ``dtype`` achieves: each the first figure found
        along the class's fallback chain (:data:`CLASS_FALLBACK`); else the peak for ``dtype``
        (:meth:`flops_per_s`), and for bytes the ``copy`` class's figure (the achieved memory
        bandwidth), else the peak bandwidth."""
        flops = bandwidth = None
        name: str | None = op_class
        while name is not None and (flops is None or bandwidth is None):
            entry = self.achieved.get(name)
            if entry is not None:
                flops = flops if flops is not None else entry.flops_per_s.get(dtype)
                bandwidth = bandwidth if bandwidth is not None else entry.bytes_per_s
            name = CLASS_FALLBACK.get(name)
        if bandwidth is None and "copy" in self.achieved:  # the device's achieved memory bandwidth
            bandwidth = self.achieved["copy"].bytes_per_s
        return (flops if flops is not None else self.flops_per_s(dtype),
                bandwidth if bandwidth is not None else self.memory_bandwidth_bytes_per_s)

    def allocated_bytes(self, nbytes: int) -> int:
        """What the device's allocator charges for a block of ``nbytes``."""
        return round_allocation(nbytes, self.device)


def round_allocation(nbytes: int, device_type: str) -> int:
    """``nbytes`` as the device's allocator counts it: CUDA rounds to 512-byte blocks; CPU counts bytes."""
    if device_type == "cuda":
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def shipped_specs() -> dict[str, Path]:
    """Name -> file of the specs shipped with memplan."""
    folder = resources.files("memplan.planner.core") / "device_specs"
    return {Path(str(f)).stem: Path(str(f)) for f in folder.iterdir() if str(f).endswith(".json")}


def parse_device_spec(text: str | bytes, *, source: str) -> DeviceSpec:
    """A :class:`DeviceSpec` from JSON text; :class:`DeviceSpecError` names the bad field."""
    data = parse_json_object(text, source=f"device spec {source}", error=DeviceSpecError)
    try:
        return DeviceSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise DeviceSpecError(f"device spec {source}: field {loc}: {err['msg']}") from None


def load_device_spec(name_or_file: str | Path) -> DeviceSpec:
    """A shipped spec by name (case-insensitive: ``h100-80gb``) or a spec file's path.

    Raises :class:`DeviceSpecError` listing the shipped names for an unknown name, and naming the field
    for a malformed file."""
    text = str(name_or_file)
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        return parse_device_spec(read_file_bytes(text, what="device spec", error=DeviceSpecError), source=text)
    shipped = shipped_specs()
    key = text.strip().lower()
    if key not in shipped:
        raise DeviceSpecError(f"unknown device spec {text!r}: shipped specs are {', '.join(sorted(shipped))} "
                              f"(or give a JSON file)")
    return parse_device_spec(shipped[key].read_bytes(), source=key)
