"""A model's training step under PyTorch's ``FakeTensorMode``: what a fake profile traces.

:func:`fake_step_state` swaps the model's parameters and buffers for fake tensors of the same shapes,
strides and dtypes on the target device (``torch.nn.utils.stateless`` reparametrisation: the user's
module and its tensors are left as they were), makes the batch fake and builds a fake optimizer of the
user's class and hyper-parameters over the fake parameters, so its state is created fake by its first
step. A model built on the meta device works the same: nothing of its size is ever allocated. A batch already
on the target device stays real (one on the CPU for a GPU here is moved there, as a real step has it), and
calls on real tensors alone run for real (:func:`fake_call`).

:func:`fake_call` runs one ATen call on fake tensors and turns the errors of a step that cannot be traced
so (an output whose shape or value depends on tensor data: ``nonzero``, ``.item()``) into one
:class:`FakeTraceError` naming the op and the module. A call whose meta function refuses what this device's
kernel runs (``_grouped_mm``'s checks are CUDA's) runs that kernel on zeros for its outputs' metadata.

The fake step must be the real one, op for op. Libraries branch on whether they are being traced:
transformers' ``is_tracing(tensor)`` is true for a ``FakeTensor`` and then builds the attention mask
another way (``masking_utils.find_packed_sequence_indices`` on position ids made by ``torch.arange``
skips its ``.all()``, so a Llama traced fake runs ``aten.expand`` where the real step runs
``aten.select``). So a small tensor made from nothing but constants (``arange``, ``ones``, ``full``: no
tensor argument, no random stream, at most :data:`REAL_CONSTANT_MAX_BYTES`) is made for real, as the
batch is, and what is computed from it and the batch alone runs for real: such code has real values to
branch on, and takes the real path. (Telling transformers that fake tensors are not traced would not do:
a branch on a fake activation's values cannot be taken at all, and is refused as above.)

Two things fake tensors do that a real step does not are undone here. Autograd replays a fake view's view
function when an in-place write rebases it (:class:`ViewReplays`: the recording modes skip those ops), and a
few meta functions lay out an output otherwise than the kernel does (:data:`KERNEL_LAYOUTS`: the output is
given the kernel's layout) or give it another size (:data:`KERNEL_SHAPES`: the kernel runs on zeros).

A branch on a random draw whose answer does not depend on the draw is taken too: transformers 5.17's
LayerDrop draws ``torch.rand([])`` in every training step and skips the layer when it is below
``layerdrop``, 0.0 by default, which no draw is. A uniform draw (``rand``, ``rand_like``) stays fake (its
values are the step's own), its range is remembered, and a comparison of it with a number that every
value in that range answers alike is made for real (:func:`_track_range`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    run_fallback_kernel,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from memplan.planner.core.errors import MemplanError
from memplan.planner.probe.device import holds_real_tensors
from memplan.planner.probe.draws import Draws, Ranges
from memplan.planner.probe.draws import refusal as draw_refusal
from memplan.planner.probe.storage import move_batch
from memplan.planner.workloads import default_optimizer

# A constant tensor (no tensor argument) up to this size is made for real in a fake step: position ids,
# index ranges and small masks, which libraries read (``.all()``, ``.item()``) to choose a path. Larger
# ones (a buffer of the model's size) stay fake: nothing of the step's size is allocated.
REAL_CONSTANT_MAX_BYTES = 1 << 20

_CANNOT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
           UnsupportedFakeTensorException)


class FakeTraceError(MemplanError):
    """The step cannot run under fake tensors (an op whose output depends on tensor values)."""


def fake_call(func: Any, args: tuple, kwargs: dict, where: str) -> Any:
    """``func(*args, **kwargs)`` under fake tensors; :class:`FakeTraceError` naming ``func`` and ``where``
    (the module running it) when fake tensors cannot run it. A call whose tensors are all real (the
    batch, and what is computed from it alone: an attention mask checked with ``.item()``) runs for real,
    below every mode, as it does in a real step."""
    tensors: list[torch.Tensor] = []
    _leaves((args, kwargs), tensors)
    if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
        with _disable_current_modes():
            return func(*args, **kwargs)
    try:
        out = _kernel_shaped(func, args, kwargs, tensors) if func in KERNEL_SHAPES else func(*args, **kwargs)
    except _CANNOT as e:
        if isinstance(e, DynamicOutputShapeException):
            # a real profile records one draw of such shapes: its plan holds for steps that draw the same
            raise FakeTraceError(f"{func} in {where} cannot run under fake tensors (its output's shape depends on "
                                 f"tensor values); profile without --fake (fake=False), where a plan holds only "
                                 f"for steps with the profiled shapes, or give the model static shapes") from None
        reason = ("its output depends on tensor values" if isinstance(e, DataDependentOutputException)
                  else "fake tensors do not support it")
        raise FakeTraceError(f"{func} in {where} cannot run under fake tensors ({reason}); "
                             f"profile without --fake (fake=False)") from None
    except RuntimeError as e:
        out = _kernel_on_zeros(func, args, kwargs, tensors, e)
    if isinstance(func, torch._ops.OpOverload):
        known = _track_range(func, args, out)
        if known is not None:
            return known
        if func in KERNEL_LAYOUTS:
            out = _kernel_layout(func, args, out)
        if func in MIXED_DTYPE_OUTPUTS:
            out = _mixed_dtype_outputs(func, args, out)
        if func in STORAGE_OF_INPUT:
            out = _storage_of_input(args[STORAGE_OF_INPUT[func]], out)
    if not tensors and _small_constant(func, out):
        with _disable_current_modes():
            return func(*args, **kwargs)
    sparse = next((t.layout for t in pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.layout != torch.strided), None)
    if sparse is not None:
        raise FakeTraceError(f"{func} in {where} makes a {str(sparse).removeprefix('torch.')} tensor (a sparse "
                             f"gradient: nn.Embedding(sparse=True)?); a fake profile traces dense tensors only: "
                             f"profile without --fake (fake=False), or use dense gradients")
    return out


_aten = torch.ops.aten
_RANGES = Ranges()  # fake tensors' known value ranges (a uniform draw's and its views')


# Outputs whose layout the kernels (CPU and CUDA alike) choose otherwise than the meta function that fake
# tensors run: (output, rule) with rule "contiguous" (the kernel allocates it contiguous), an argument's
# index (in that argument's suggested memory format: channels-last in, channels-last out, else contiguous)
# or a pair of argument indices (the kernel is an elementwise TensorIterator over the gradient and the
# input: the layout ``add`` of the two gets, whose meta function is that iterator's), where the meta
# function (a Python decomposition) follows one argument's strides. A fake output of another layout changes what the
# step copies later (a reshape of a non-contiguous gradient copies; Swin's layer norm after a permute had
# an 8 KiB copy in the fake graph that the real step never made). Found by running each op on permuted
# inputs and gradients, real against fake; tests/test_fake.py checks every entry against the kernel.
KERNEL_LAYOUTS: dict[Any, tuple[tuple[int, str | int | tuple[int, int]], ...]] = {
    _aten.native_layer_norm_backward.default: ((0, "contiguous"),),
    _aten._log_softmax_backward_data.default: ((0, "contiguous"),),
    _aten.mse_loss_backward.default: ((0, "contiguous"),),
    _aten.native_batch_norm.default: ((0, 0),),
    _aten.native_batch_norm_backward.default: ((0, 1),),
    _aten.smooth_l1_loss_backward.default: ((0, "contiguous"),),
    _aten.huber_loss_backward.default: ((0, "contiguous"),),
    _aten.log_sigmoid_forward.default: ((0, "contiguous"), (1, "contiguous")),
    _aten.softplus_backward.default: ((0, (0, 1)),),
    _aten.hardswish_backward.default: ((0, (0, 1)),),
    _aten.hardsigmoid_backward.default: ((0, (0, 1)),),
    _aten.hardtanh_backward.default: ((0, (0, 1)),),
    _aten.elu_backward.default: ((0, (0, 5)),),
}


# Ops whose meta function gives an output another size than the kernel makes, where the kernel's does not
# depend on the inputs' values: such a call runs the device's kernel on zeros (:func:`_kernel_on_zeros`).
# ``mkldnn_rnn_layer`` (nn.LSTM on a CPU) returns its workspace, which its backward saves, as uint8[0] from
# the meta function; oneDNN's is the primitive's own size (335,872 B for a 2-layer LSTM of width 64 over
# 20 steps of 4 sequences), and the executor refused the real step's tensor as another model's.
KERNEL_SHAPES = frozenset({_aten.mkldnn_rnn_layer.default})

# Normalisations on a CPU with a bfloat16 or float16 input and float32 weights, biases or statistics ("mixed
# dtype (CPU)"): what autocast on a CPU runs, a bfloat16 activation into the module's float32 LayerNorm,
# GroupNorm or BatchNorm. The CPU's kernels keep the statistics they return (mean and rstd / invstd, which
# backward saves) in float32, and group norm's backward returns the input's gradient in the input's dtype;
# the meta functions (torch._refs' layer norm, the batch- and group-norm decompositions) give the statistics
# the input's dtype and that gradient float32. The fake graph had the statistics at half their bytes and a
# cast autograd added after group norm's backward, and the executor refused the real step ("float32[8, 32, 1];
# the profiled graph has bfloat16[8, 32, 1]"). Per op: (output index, the index of the argument whose dtype
# it takes, or None for float32), applied where the trace runs the CPU's kernels (not a GPU's: CUDA keeps
# its own accumulation dtype, which its meta functions follow). tests/test_fake.py checks them against the
# kernels.
MIXED_DTYPE_OUTPUTS: dict[Any, tuple[int, tuple[tuple[int, int | None], ...]]] = {
    # op: (the input's argument index, ((output, dtype source), ...))
    _aten.native_layer_norm.default: (0, ((1, None), (2, None))),
    _aten.native_group_norm.default: (0, ((1, None), (2, None))),
    _aten.native_batch_norm.default: (0, ((1, None), (2, None))),
    _aten.native_group_norm_backward.default: (1, ((0, 1),)),
}
_REDUCED = (torch.bfloat16, torch.float16)

# Ops whose CPU kernel returns its output in a storage the size of an input (it allocates like the input,
# then resizes smaller): ``col2im``, ``F.unfold``'s backward (``F.fold``), returns the [6, 4, 4, 4] gradient
# of a [6, 16, 9] column tensor in a 3,456-byte storage, where the meta function's is 1,536 bytes; the
# fake graph then read the difference as the backward's scratch instead of the gradient's bytes. Per op,
# the index of that input; for the CPU's kernels only.
STORAGE_OF_INPUT: dict[Any, int] = {_aten.col2im.default: 0}


def _storage_of_input(x: Any, out: Any) -> Any:
    """``out`` as a view of a fresh storage of ``x``'s bytes where that is larger and the kernel is the CPU's
    (:data:`STORAGE_OF_INPUT`)."""
    from memplan.planner.probe.kernels import gpu_choices_active

    if (not isinstance(out, FakeTensor) or not isinstance(x, FakeTensor) or out.device.type != "cpu"
            or gpu_choices_active() or x.dtype != out.dtype or not out.is_contiguous()):
        return out
    if x.untyped_storage().nbytes() <= out.untyped_storage().nbytes():
        return out
    flat = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=out.dtype, device=out.device)
    return flat.as_strided(out.shape, out.stride())


def _mixed_dtype_outputs(func: Any, args: tuple, out: Any) -> Any:
    """``out`` with the dtypes a CPU's kernel gives a :data:`MIXED_DTYPE_OUTPUTS` call whose input is reduced
    precision beside a float32 tensor argument (fresh fake tensors of the same shapes and strides: the
    kernel allocates these outputs)."""
    from memplan.planner.probe.kernels import gpu_choices_active

    at, rules = MIXED_DTYPE_OUTPUTS[func]
    x = args[at] if len(args) > at else None
    if (not isinstance(x, FakeTensor) or x.device.type != "cpu" or x.dtype not in _REDUCED
            or gpu_choices_active() or not isinstance(out, (tuple, list))):
        return out
    if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
        return out
    outs = list(out)
    for index, source in rules:
        t = outs[index] if index < len(outs) else None
        dtype = torch.float32 if source is None else args[source].dtype
        if isinstance(t, FakeTensor) and t.dtype != dtype:
            outs[index] = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    return type(out)(outs)


def _kernel_shaped(func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
    """A :data:`KERNEL_SHAPES` call's outputs as the kernel makes them; the meta function's where the kernel
    cannot run here (a fake device without real tensors)."""
    try:
        return _kernel_on_zeros(func, args, kwargs, tensors, RuntimeError(f"{func}: no kernel here"))
    except RuntimeError:
        return func(*args, **kwargs)


def _kernel_layout(func: Any, args: tuple, out: Any) -> Any:
    """``out`` with the outputs :data:`KERNEL_LAYOUTS` names in the kernel's layout (fresh fake tensors: the
    kernel allocates these outputs, so nothing aliases them)."""
    from torch._prims_common import suggest_memory_format

    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for index, rule in KERNEL_LAYOUTS[func]:
        t = outs[index] if index < len(outs) else None
        if not isinstance(t, FakeTensor):
            continue
        if isinstance(rule, tuple):
            like = _aten.add.Tensor(args[rule[0]], args[rule[1]])
            if like.shape == t.shape and like.stride() != t.stride():
                outs[index] = torch.empty_strided(t.shape, like.stride(), dtype=t.dtype, device=t.device)
            continue
        fmt = torch.contiguous_format if rule == "contiguous" else suggest_memory_format(args[rule])
        if not t.is_contiguous(memory_format=fmt):
            outs[index] = torch.empty_like(t, memory_format=fmt)
    return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]


def _track_range(func: Any, args: tuple, out: Any) -> torch.Tensor | None:
    """Follow the known ranges of values (:data:`_RANGES`); a comparison of a tensor with a known range and
    a number that every value in the range answers alike (``torch.rand([]) < 0.0`` is false) returns that
    answer made for real, when it is small enough to make here; None otherwise."""
    _RANGES.note(func, args, out)
    if not isinstance(out, FakeTensor) or not args or not isinstance(args[0], FakeTensor):
        return None
    answer = _RANGES.answer(func, args)
    if answer is None or out.numel() * out.element_size() > REAL_CONSTANT_MAX_BYTES:
        return None
    if not holds_real_tensors(out.device):
        return None
    with _disable_current_modes():
        real = torch.empty_strided(tuple(out.shape), tuple(out.stride()), dtype=out.dtype, device=out.device)
        return real.fill_(answer)


def _kernel_on_zeros(func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                     refused: RuntimeError) -> Any:
    """A call the op's meta function refused, run by the device's own kernel on zero-filled real tensors
    of the fake arguments' shapes, strides and dtypes; its outputs, made fake, are the kernel's (shapes,
    strides, storage sizes). A meta function may be stricter than this device's kernel: ``_grouped_mm``'s
    checks are CUDA's (bfloat16 only), while the CPU kernel multiplies float32, and transformers' mixture-
    of-experts layers call it so on the CPU. Sound only where the outputs' metadata does not depend on
    the inputs' values: ops tagged data-dependent never get here (fake tensors refuse them first, above),
    and an op that changes an input's metadata in place is not run so. Where the kernel refuses too (the
    real step would fail with it), or cannot run here (a spec's GPU that is not here), the meta function's
    error stands."""
    fakes = [t for t in tensors if isinstance(t, FakeTensor)]
    if (not isinstance(func, torch._ops.OpOverload) or torch.Tag.inplace_view in func.tags or not fakes
            or not all(holds_real_tensors(t.fake_device) for t in fakes)):
        raise refused
    flat, spec = pytree.tree_flatten((args, kwargs))
    try:
        return run_fallback_kernel(fakes[0].fake_mode, func, flat, spec, refused)
    except RuntimeError:
        raise refused from None


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Inside: ``FakeTensorMode`` does not log a traceback when an op's meta function raises
    (:func:`fake_call` runs the kernel instead, or the error becomes the step's one-line refusal)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _small_constant(func: Any, out: Any) -> bool:
    """Whether ``out`` (fake), made by ``func`` from no tensor, is a constant small enough to make for
    real: not drawn from a random stream, at most :data:`REAL_CONSTANT_MAX_BYTES`, on a device here."""
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    outs: list[torch.Tensor] = []
    _leaves(out, outs)
    if not outs or not all(isinstance(t, FakeTensor) for t in outs):
        return False
    if sum(t.numel() * t.element_size() for t in outs) > REAL_CONSTANT_MAX_BYTES:
        return False
    return all(holds_real_tensors(t.device) for t in outs)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments: ``self`` of ``copy_``,
    ``out=``)."""
    spec = _WRITTEN.get(func)
    if spec is None:
        schema = getattr(func, "_schema", None)
        spec = () if schema is None else tuple((i, a.name) for i, a in enumerate(schema.arguments)
                                               if a.alias_info is not None and a.alias_info.is_write)
        _WRITTEN[func] = spec
    out: list[torch.Tensor] = []
    for i, name in spec:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> its mutable arguments (index, name)


class ViewReplays:
    """Autograd's replays of fake views, which are not ops of the program.

    A view of a fake tensor (a subclass with the Python dispatch key) keeps the view function that made it
    rather than as_strided metadata. When an in-place write makes such a view require grad
    (``buf[..., :n].copy_(x)``, ``out[i] = y``; DeepSeek-V3's attention builds its keys so), autograd
    rebases the view's history and rebuilds its ``grad_fn`` by replaying that function on the base: one view
    op per level of the view (``select`` then ``slice`` for ``buf[i][..., :n]``), dispatched to every mode
    like the program's own ops, inside the write's call and with the view's autograd mutex held. A real step
    does none of this. So a mode that records a fake step skips them (else the fake graph has ops the real
    step never runs, and the executor's matching refuses the plan), and must not read that view's
    ``grad_fn`` while one runs: the read takes the same mutex, and the step waited on it forever.

    The base's *other* views are stale after such a write, and autograd rebuilds each one lazily, when the
    program next reads it: its view function replayed on the base just before the op that reads it
    (Longformer masks its attention scores through one view of them, then slices another). Those replays
    are told from the program's own view ops only once the next op shows: ops that repeat, from the root
    base, the chain of views that made a stale view, directly followed by an op that reads that view. So
    the recording mode holds a chain that may be such a replay (``lazy``: True, run the call, give its
    output to ``held``) and asks ``settle`` at the next op, and before the forward ends, what to record of
    it: nothing when it was a replay, else the held calls, in order, as the program's.

    Use: ``replaying(func, args)`` first in ``__torch_dispatch__`` (True: run the call, give its output to
    ``replayed``, record nothing); then ``route`` (``lazy`` / ``held`` / ``settle`` as above), and ``flush``
    before the forward ends; ``after_write(func, args, kwargs)`` and ``made(func, args, kwargs, out)`` once
    a recorded call has run."""

    def __init__(self) -> None:
        self._next: torch.Tensor | None = None  # what the next replayed view op is applied to
        self._written: torch.Tensor | None = None  # the view a write rebased: fresh once its replay ran
        # every live fake view the program made: (its root base, weakly; its chain of view calls from it;
        # the version of its data when its grad_fn was last made)
        self._views: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._of_root: WeakIdKeyDictionary = WeakIdKeyDictionary()  # root base -> its views (weak keys)
        self._held: list[tuple[Any, tuple, dict, Any, str]] = []  # (func, args, kwargs, out, module) held calls
        self._candidates: list[torch.Tensor] = []  # stale views whose chain the held calls follow
        self._last: Any = None  # the last held call's output (the next level applies to it)

    def after_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Expect a replay after ``func`` when it wrote a fake view in place and autograd will rebase it: grad
        mode on and the write's arguments (the view included) requiring grad."""
        self._next = self._written = None
        if not torch.is_grad_enabled():
            return
        written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, FakeTensor) and t._is_view()]
        if written and any(t.requires_grad for t in pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor)):
            self._next = written[0]._base  # every level of a view of a view replays from the root base
            self._written = written[0]

    def replaying(self, func: Any, args: tuple) -> bool:
        """Whether this call is a replayed view op (the next one after a rebasing write, or the next level of
        the replay under way); forgets the expectation otherwise."""
        nxt, self._next = self._next, None
        return (nxt is not None and getattr(func, "is_view", False) and len(args) > 0 and args[0] is nxt)

    def replayed(self, out: Any) -> None:
        """The replayed op's output: a deeper level of the view replays from it."""
        self._next = out if isinstance(out, torch.Tensor) else None
        if self._written is not None and self._next is not None and self._written in self._views:
            root, chain, _ = self._views[self._written]
            self._views[self._written] = (root, chain, self._next._version)  # rebased: its grad_fn is fresh

    @staticmethod
    def _step(func: Any, args: tuple, kwargs: dict) -> tuple:
        return (func, tuple(args[1:]), tuple(sorted(kwargs.items())))

    def made(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note the fake views a recorded view op made, with their chain from the root base."""
        if not getattr(func, "is_view", False) or not args or not isinstance(args[0], FakeTensor):
            return
        parent = args[0]
        if parent in self._views:
            root, chain, _ = self._views[parent]
        elif parent._is_view():
            return  # a view made outside the trace: its chain is not known
        else:
            root, chain = weakref.ref(parent), ()  # weak: the record must not keep the base's storage alive
        base = root()
        if base is None:
            return
        mine = self._of_root.setdefault(base, WeakIdKeyDictionary())
        step = self._step(func, args, kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):  # views: autograd marks them so only once this call returns
            if isinstance(t, FakeTensor):
                level = (*step, i if isinstance(out, (tuple, list)) else None)
                self._views[t] = (root, (*chain, level), t._version)
                mine[t] = None

    def lazy(self, func: Any, args: tuple, kwargs: dict, module: str = "") -> bool:
        """Whether to hold this call (run in ``module``) as the next level of a possible lazy replay (see
        the class)."""
        if not getattr(func, "is_view", False) or not args or not isinstance(args[0], FakeTensor):
            return False
        step = self._step(func, args, kwargs)
        if self._held:
            level = len(self._held)
            if args[0] is not self._last:
                return False
            following = [v for v in self._candidates
                         if len(self._views[v][1]) > level and self._views[v][1][level][:3] == step]
            if not following:
                return False
            self._candidates = following
            self._held.append((func, args, kwargs, None, module))
            return True
        mine = self._of_root.get(args[0])
        if not mine:
            return False
        stale = [v for v in mine if self._views[v][1][0][:3] == step and v._version != self._views[v][2]]
        if not stale:
            return False
        self._candidates = stale
        self._held.append((func, args, kwargs, None, module))
        return True

    def held(self, out: Any) -> None:
        """The held call's output."""
        func, args, kwargs, _, module = self._held[-1]
        level = len(self._held) - 1
        index = next((self._views[v][1][level][3] for v in self._candidates), None)
        self._held[-1] = (func, args, kwargs, out, module)
        self._last = out[index] if index is not None and isinstance(out, (tuple, list)) else out

    def route(self, func: Any, args: tuple, kwargs: dict, module: str, record: Any, run: Any) -> Any:
        """A recording mode's forward call through the check above: held (``run(func, args, kwargs)``, its
        output returned) while it may be autograd rebuilding a stale view; else the held calls that were the
        program's, then this one, go to ``record(func, args, kwargs, done, module)`` (``done``: ``(out,)``
        of a held call that ran already, None for this one)."""
        if not self.lazy(func, args, kwargs, module):
            self.flush(args, kwargs, record)  # what was held is settled by this call ...
            if not self.lazy(func, args, kwargs, module):  # ... which may begin a chain
                return record(func, args, kwargs, None, module)
        out = run(func, args, kwargs)
        self.held(out)
        return out

    def flush(self, args: tuple, kwargs: dict | None, record: Any) -> None:
        """Give ``record`` the held calls that were the program's own (:meth:`settle`), in order."""
        for func, a, kw, out, module in self.settle(args, kwargs):
            record(func, a, kw, (out,), module)

    def settle(self, args: tuple = (), kwargs: dict | None = None) -> list[tuple[Any, tuple, dict, Any, str]]:
        """The held calls to record as the program's before the call with ``args`` / ``kwargs`` (none when
        they replayed a stale view that call reads: that view's grad_fn is fresh now). Empty when nothing
        is held; with no arguments (the forward's end) every held call is the program's."""
        if not self._held:
            return []
        held, self._held = self._held, []
        candidates, self._candidates, self._last = self._candidates, [], None
        read = {id(t) for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        for v in candidates:
            root, chain, _ = self._views[v]
            if len(chain) == len(held) and id(v) in read:
                self._views[v] = (root, chain, v._version)
                return []
        return held


class FakeGuard(TorchDispatchMode):
    """Runs every call through :func:`fake_call`, naming the module on top of ``modules`` (kept by the
    profiler's module hooks): for the fake steps that are not traced (the warm-up)."""

    def __init__(self, modules: list[str]):
        super().__init__()
        self.modules = modules
        self.model_called = False
        self.backward_seen = False  # a call ran inside an autograd node: what follows outside the model is the
                                    # optimizer's
        self.draws = Draws()        # tensors whose values are a random draw's (a branch on one is named)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is not None:
            self.backward_seen = True
            where = f"the backward ({node.name()})"
        elif self.modules:
            where = self.modules[-1]
        else:  # outside the model: before its backward the loss, after it the optimizer's step
            where = ("the optimizer step" if self.backward_seen else "loss") if self.model_called else "the step"
        kwargs = kwargs or {}
        branch = self.draws.is_branch(func, args) and isinstance(args[0], FakeTensor)
        try:
            out = fake_call(func, args, kwargs, where or "the model")
        except FakeTraceError as e:
            if not branch:
                raise
            raise FakeTraceError(draw_refusal(e.args[0], where)) from None
        self.draws.note(func, args, kwargs, out)
        return out


@dataclass
class FakeState:
    """What a fake step runs on: the fake batch and optimizer, the fake tensors by kind, and the mode."""

    mode: FakeTensorMode
    batch: Any
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    inputs: list[torch.Tensor]


@contextlib.contextmanager
def fake_step_state(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
                    device: torch.device) -> Iterator[FakeState]:
    """Inside: ``model``'s parameters and buffers are fake tensors on ``device`` (tied ones stay tied)
    and ``FakeTensorMode`` is active, so every tensor the step creates is fake. Yields the
    :class:`FakeState`; on exit the model has its own tensors back."""
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        f = memo.get(id(t))
        if f is None:
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
            if t.requires_grad:
                f.requires_grad_(True)
            memo[id(t)] = f
        return f

    swapped = {name: fake_of(p) for name, p in model.named_parameters(remove_duplicate=False)}
    swapped |= {name: fake_of(b) for name, b in model.named_buffers(remove_duplicate=False)}
    inputs: list[torch.Tensor] = []
    _leaves(batch, inputs)
    # The batch is real where the step has it real (it is small, and the model may look at its values:
    # transformers skips the mask of an all-ones attention mask, and builds it for a fake one): already on
    # the device, or moved there as run_plan moves it when the device is here. A batch on the meta
    # device, or for a device not here (a device spec's), is faked.
    if all(t.device == device for t in inputs):
        fake_batch = batch
    elif holds_real_tensors(device) and not any(t.is_meta for t in inputs):
        fake_batch = move_batch(batch, device)
    else:
        fake_batch = _map(batch, fake_of)
    inputs = []
    _leaves(fake_batch, inputs)
    with _reparametrize_module(model, swapped, tie_weights=True, strict=False), mode, quiet_meta_failures():
        params = [p for _, p in model.named_parameters()]
        buffers = [b for _, b in model.named_buffers()]
        fake_opt = _fake_optimizer(optimizer, fake_of) if optimizer is not None else default_optimizer(model)
        yield FakeState(mode, fake_batch, fake_opt, params, buffers, inputs)


def _fake_optimizer(optimizer: torch.optim.Optimizer, fake_of: Any) -> torch.optim.Optimizer:
    """The user's optimizer class and hyper-parameters (group by group) over the fake parameters."""
    groups = [{**g, "params": [fake_of(p) for p in g["params"]]} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)


def _map(x: Any, fn: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)({k: _map(v, fn) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        items = [_map(v, fn) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _leaves(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)
