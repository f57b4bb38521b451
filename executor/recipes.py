"""What forward records for a replay, and what a compiled replay repeats (plain data and helpers).

* :class:`Recipe`: how to replay forward op ``k``: the ATen op, its arguments with activations as
  :class:`Ref` (tensor id and view geometry), where its new storages are among its outputs, and the RNG
  state it ran from. A constant the model makes from Python data (``lift_fresh``'s argument) is kept as a
  :class:`HostConstant`.
* :class:`Segment` and :class:`CompiledOp`: a replay planned once per availability state and compiled on
  its first run (see the comment above ``SEGMENTS_PER_TARGET``), reused while later steps' recipes keep
  their signatures (:func:`recipe_signature`).
* Views over storages (:func:`storage_view`, :func:`byte_view`), the arguments an op writes in place
  (:func:`written_arguments`) and their clones (:func:`clone_at`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.planner.core.replay import Replay
from memplan.planner.probe.device import HostBytes
from memplan.planner.probe.storage import map_leaves


@dataclass(frozen=True)
class Ref:
    """A tensor argument of a recorded op that lives in an activation storage: its tensor id and view."""

    tid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


FRESH_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


@dataclass(frozen=True, eq=False)
class HostConstant:
    """The argument of a recorded ``lift_fresh``: a tensor the model made from Python data in forward
    (``torch.tensor(0.0, device=...)``, as transformers 5.17 builds its attention mask), which the graph
    has its ``lift_fresh`` create and a replay re-create. Its bytes are kept on the host, outside the
    device's allocator (:class:`HostBytes`: no host sync on a GPU), and :meth:`tensor` makes a fresh device
    copy for each replay. The recipe holding the tensor itself kept it allocated all step where plain
    PyTorch frees it after its last use: a replay then found it resident instead of rebuilding it (one op
    fewer than the schedule's), the device held bytes the simulator does not charge, and a forward without
    backward left it allocated."""

    data: HostBytes
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> HostConstant:
        return HostConstant(HostBytes(t.untyped_storage()), t.dtype, tuple(t.size()), tuple(t.stride()),
                            t.storage_offset())

    def geometry(self) -> tuple:
        return ("constant", self.dtype, self.data.device, self.size, self.stride, self.offset, self.data.nbytes)

    def tensor(self) -> torch.Tensor:
        """A new device tensor with the constant's bytes and geometry."""
        return storage_view(self.data.storage(), self.dtype, self.size, self.stride, self.offset, self.data.device)


@dataclass
class Recipe:
    """How to replay forward op ``k``: the ATen op, arguments with activations as :class:`Ref`, the
    positions (in its flattened outputs) of its new storages and their tensor ids, and the RNG state.
    ``slots``: where the activations are when all of them are top-level arguments (positional index or
    keyword name, and the reference), so a replay fills them in without walking the arguments; None
    when one is nested (a list of tensors), and the replay maps the arguments' leaves."""

    func: Any
    args: Any
    kwargs: Any
    new: list[tuple[int, int]]
    rng: tuple[bytearray, bytearray | None] | None   # generator states (CPU, CUDA) as host bytes
    slots: list[tuple[int | str, Ref]] | None = None


def activation_slots(args: tuple, kwargs: dict) -> list[tuple[int | str, Ref]] | None:
    """The top-level positions of a recorded op's activation arguments, or None if one is nested."""
    out: list[tuple[int | str, Ref]] = [(i, a) for i, a in enumerate(args) if type(a) is Ref]
    out += [(k, a) for k, a in kwargs.items() if type(a) is Ref]
    nested = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple, dict))]
    return None if nested and any(type(x) is Ref for x in _leaves(nested)) else out


def _leaves(x: Any) -> list[Any]:
    """Every leaf of nested arguments (lists, tuples, dict values)."""
    out: list[Any] = []
    map_leaves(out.append, x)
    return out


# ---- compiled replays -----------------------------------------------------------------------------
# A replay is planned by ``replay()`` from the step's answers to its questions about tensors (available?
# fetchable? retained?), and those are the same at the same point of every step: a Segment keeps the
# plan with the questions it asked and is reused when a later step answers them alike. Its first run is
# traced into CompiledOps: for each op where each activation argument comes from (the tensor an earlier
# op of the replay returned, a view of a storage it re-created, a view of a resident one), which written
# arguments are cloned, and what becomes of each new output; a later run repeats those decisions on that
# step's recipes as long as their signatures (recipe_signature) are the traced ones.
SEGMENTS_PER_TARGET = 4       # availability states remembered per target
COMPILED_PER_SEGMENT = 4      # recipe signatures (batch shapes of a shape family...) per segment
SIGNATURES_PER_OP = 8         # signatures remembered per recorded op
AVAILABLE, FETCHABLE, RETAINED = 0, 1, 2   # replay()'s questions
DIRECT, MADE_VIEW, RESIDENT = 0, 1, 2      # where an activation argument comes from
DROP, SCRATCH, REBUILT = 0, 1, 2           # what becomes of a new output


@dataclass(frozen=True)
class CompiledOp:
    """One op of a compiled replay. ``op``: its id; ``signature``: the id of its recipe's signature when it
    was traced; ``fills``: (argument position or keyword, tensor id, source, view geometry (dtype, size,
    stride, offset) or None for a direct read) per activation argument, None when one is nested (the op is
    then run by ``Step._run``, argument leaf by leaf); ``clones``: written arguments cloned; ``roles``: per
    new output (the recipe's ``new`` order) dropped, kept as a scratch copy, or rebuilt; ``frees``: the
    re-created tensors freed after it."""

    op: int
    signature: int
    fills: tuple[tuple[int | str, int, int, tuple | None], ...] | None
    clones: tuple[int | str, ...]
    roles: tuple[int, ...]
    frees: tuple[int, ...]


@dataclass
class Segment:
    """A planned replay (``replay``), the questions ``replay()`` asked to plan it with their answers
    ((question, tensor id, answer)), and its compilations, newest first."""

    replay: Replay
    questions: tuple[tuple[int, int, bool], ...]
    compiled: list[tuple[CompiledOp, ...]] = field(default_factory=list)


_PLAIN = frozenset((type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format, Ref))


def recipe_signature(rec: Recipe) -> tuple | None:
    """What a compiled op depends on in a recipe: the ATen op, its new outputs' positions, and its
    arguments with every tensor replaced by its geometry (dtype, device, size, stride, offset), lists as
    tuples, and constants as they are. Two recipes with equal signatures are replayed with the same
    decisions. None when an argument is of a kind that cannot be compared safely (the op then always runs
    traced)."""
    try:
        return (rec.func, tuple(rec.new), tuple(_leaf_signature(a) for a in rec.args),
                tuple(sorted((k, _leaf_signature(v)) for k, v in rec.kwargs.items())))
    except TypeError:
        return None


def _leaf_signature(x: Any) -> Any:
    if type(x) in _PLAIN:
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.device, tuple(x.size()), tuple(x.stride()), x.storage_offset())
    if type(x) is HostConstant:  # its value is the recipe's data, as a tensor argument's is
        return x.geometry()
    if isinstance(x, (list, tuple)):
        return tuple(_leaf_signature(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _leaf_signature(v)) for k, v in x.items()))
    raise TypeError(f"{type(x).__name__} in a recipe's arguments")

def storage_view(storage: torch.UntypedStorage, dtype: torch.dtype, size, stride, offset: int,
          device: torch.device | None = None) -> torch.Tensor:
    """A tensor over ``storage`` with this geometry (``device``: the storage's, when the caller knows it:
    reading ``storage.device`` costs as much as building the view)."""
    return torch.empty(0, dtype=dtype, device=device or storage.device).set_(storage, offset, size, stride)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return storage_view(storage, torch.uint8, (storage.nbytes(),), (1,), 0)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s own bytes as a uint8 view of its storage (a contiguous tensor's: a pool slot's view, a
    parameter, a gradient, a state tensor), what the copy streams copy."""
    start = t.storage_offset() * t.element_size()
    return byte_view(t.untyped_storage())[start:start + t.numel() * t.element_size()]


def storage_key(t: torch.Tensor) -> int | None:
    """The key ``Step.by_key`` knows ``t``'s storage by, or None if it has none (a tensor whose storage
    ``storage_of`` does not count is never registered, so looking its key up finds nothing either)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


_WRITES: dict[Any, list[tuple[int, str]]] = {}

def written_arguments(rec: Recipe, made: dict[int, torch.UntypedStorage]) -> list[int | str]:
    """The arguments (positions, or keyword names) ``rec.func`` writes in place that a replay must clone
    (a replay must not mutate state): all of them except storages the running replay rebuilds
    (``made``): an in-place initialiser writes the tensor it is replayed for."""
    func = rec.func
    spec = _WRITES.get(func)
    if spec is None:
        # torch's schema info, not the schema's annotations alone: ``native_batch_norm`` writes its running
        # statistics in training without marking them ``(a!)`` (a replay of it updated them a second time)
        info = torch._C._SchemaInfo(func._schema)
        spec = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                if info.is_mutable(torch._C._SchemaArgument(torch._C._SchemaArgType.input, i))]
        _WRITES[func] = spec
    if not spec:
        return []
    keep = {i for i, a in enumerate(rec.args) if isinstance(a, Ref) and a.tid in made}
    keep |= {k for k, a in rec.kwargs.items() if isinstance(a, Ref) and a.tid in made}
    out: list[int | str] = []
    for i, name in spec:
        if i in keep or name in keep:
            continue
        if i < len(rec.args):
            out.append(i)
        elif name in rec.kwargs:
            out.append(name)
    return out


def clone_at(args, kwargs, at: list[int | str] | tuple[int | str, ...]):
    """``args`` and ``kwargs`` with the tensors at positions or keyword names ``at`` cloned."""
    args = list(args)
    kwargs = dict(kwargs)
    for i in at:
        if type(i) is int:
            args[i] = map_leaves(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args[i])
        else:
            kwargs[i] = map_leaves(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, kwargs[i])
    return tuple(args), kwargs

