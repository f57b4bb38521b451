"""Device specifications: what an analytic op time needs to know about a device you may not have.

A spec is a small JSON file (``memplan.planner.core.device_specs/*.json`` ships A100-80GB, H100-80GB, L4 and
RTX 4090; any file of the same shape works)::

    {"name": "h100-80gb", "device": "cuda", "memory_bytes": 85899345920,
     "peak_flops_per_s": {"float32": 67e12, "bfloat16": 989.4e12, ...},
     "memory_bandwidth_bytes_per_s": 3.35e12, "host_bandwidth_bytes_per_s": 50e9, "op_overhead_s": 4e-6}

An op's analytic time is the roofline ``op_overhead_s + max(flops / peak_flops_per_s[dtype],
bytes_moved / memory_bandwidth_bytes_per_s)`` (:mod:`memplan.planner.probe.optime`). Torch-free: pydantic only.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.files import parse_json_object, read_file_bytes

PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# The CUDA caching allocator rounds every block up to a multiple of 512 bytes (kMinBlockSize), and
# torch.cuda.memory_allocated counts the rounded size.
CUDA_BLOCK_BYTES = 512


class DeviceSpecError(MemplanError):
    """A ``--device-spec`` that is neither a shipped name nor a valid spec file."""


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
    op_overhead_s: float = Field(default=5e-6, ge=0, allow_inf_nan=False,
                                 description="fixed cost of launching one op")
    workspace_bytes: int = Field(
        default=0, ge=0, le=2**50,
        description="device memory a training step's libraries hold that no tensor owns (cuBLAS workspaces: "
                    "one per handle and stream, for forward's thread and autograd's device thread)")

    def flops_per_s(self, dtype: str) -> float:
        """The peak for ``dtype`` ("float32", ...); float32's when the spec has none for it (integer ops)."""
        return self.peak_flops_per_s.get(dtype) or self.peak_flops_per_s.get("float32") or \
            min(self.peak_flops_per_s.values())

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
