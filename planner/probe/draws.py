"""Branches on random draws: a step whose Python code decides on a random number which ops to run.

LayerDrop is the common case: transformers' audio encoders (Wav2Vec2, HuBERT, WavLM, Data2Vec-Audio:
``layerdrop=0.1`` by default) draw ``torch.rand([])`` before each layer in training and skip the layer
when it falls below ``layerdrop``. Such a step runs other ops from one step to the next, and a plan is made
for the ops of the profiled one: the executor refused a later step at random (the plan expects a
layer's op, the model ran the next draw), hundreds of steps into a run.

:class:`Draws` follows, through a traced forward, the tensors whose values are a draw's alone: the outputs
of a draw that reads no tensor's values (``rand``, ``randn``, ``randint``, ``randperm`` and their ``_like``
forms), and those of any op that reads only such tensors (a comparison with a number, a view), but for a
comparison that every value of a uniform draw answers alike (``torch.rand([]) < 0.0``). A call that
turns one into a Python value (``.item()``, ``bool()``, ``if``: ``aten._local_scalar_dense``,
``aten.is_nonzero``) is a branch on a draw. A real profile records where (``graph.meta["draw_branches"]``)
and warns; the executor's refusal of a step that differs names it. A branch whose ops do not depend on the
value (a scale factor) traces and trains as any step; it is not refused for that.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

_aten = torch.ops.aten
# draws whose values depend on no tensor's values (a ``_like`` form reads only its argument's shape)
DRAWS = frozenset({_aten.rand, _aten.randn, _aten.randint, _aten.randperm, _aten.rand_like, _aten.randn_like,
                   _aten.randint_like})
# calls that turn a tensor into a Python value the program can branch on
TO_PYTHON = frozenset({_aten._local_scalar_dense.default, _aten.is_nonzero.default})
# uniform draws: their values lie in [0, 1), taken as [0, 1] so as not to rely on how a kernel treats 1
UNIFORM = (_aten.rand, _aten.rand_like)


def _answer(always: bool, never: bool) -> bool | None:
    return True if always else False if never else None


# a comparison ``x OP c`` of values x in [low, high] with a number c: its one answer, or None if it depends on x
COMPARISONS = {
    _aten.lt: lambda low, high, c: _answer(high < c, low >= c),
    _aten.le: lambda low, high, c: _answer(high <= c, low > c),
    _aten.gt: lambda low, high, c: _answer(low > c, high <= c),
    _aten.ge: lambda low, high, c: _answer(low >= c, high < c),
}

ADVICE = ("its steps run different ops at random (LayerDrop, stochastic depth by branching), and a plan holds "
          "only for steps that run the profiled ones; turn it off to train under a plan (transformers: "
          "layerdrop=0.0)")


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class Ranges:
    """The ranges of tensors' values where they are known: a uniform draw's ([0, 1]) and a view's of a
    tensor with a known range (the ``detach`` of a draw); an op that writes in place forgets them all (it
    may change a remembered tensor's values through any view of it). The fake trace answers a comparison
    that every value answers alike (planner/probe/fake.py); :class:`Draws` takes it for no branch."""

    def __init__(self) -> None:
        self._of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (low, high)

    def note(self, func: Any, args: tuple, out: Any) -> None:
        """After ``func`` ran with ``args`` and gave ``out``."""
        schema = getattr(func, "_schema", None)
        if self._of and schema is not None and schema.is_mutable:
            self._of.clear()
        if not isinstance(out, torch.Tensor):
            return
        if getattr(func, "overloadpacket", None) in UNIFORM:
            self._of[out] = (0.0, 1.0)
            return
        x = args[0] if args and self._of and isinstance(args[0], torch.Tensor) else None
        bounds = self._of.get(x) if x is not None else None
        if (bounds is not None and schema is not None and schema.returns and schema.returns[0].alias_info is not None
                and out.dtype == x.dtype):  # a view with the same values, unless it reinterprets their bytes
            self._of[out] = bounds

    def answer(self, func: Any, args: tuple) -> bool | None:
        """The one answer of ``func`` when it compares a tensor of known range with a number and every value
        in the range answers alike (``torch.rand([]) < 0.0`` is False); None otherwise."""
        if not self._of or not args or not isinstance(args[0], torch.Tensor):
            return None
        bounds = self._of.get(args[0])
        decide = COMPARISONS.get(getattr(func, "overloadpacket", None))
        c = args[1] if len(args) > 1 else None
        if bounds is None or decide is None or type(c) not in (int, float):
            return None
        return decide(*bounds, c)


class Draws:
    """The tensors of a forward whose values are a random draw's alone (module docstring)."""

    def __init__(self) -> None:
        self._drawn: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._ranges = Ranges()  # a uniform draw's (or its views') values

    def is_branch(self, func: Any, args: tuple) -> bool:
        """Whether ``func`` turns a drawn tensor into a Python value."""
        return func in TO_PYTHON and bool(args) and isinstance(args[0], torch.Tensor) and args[0] in self._drawn

    def note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """After ``func`` ran: its outputs (and what it wrote) are drawn when it is a draw, or when every
        tensor it read was drawn; a write with anything else makes the written tensor no draw's alone."""
        packet = getattr(func, "overloadpacket", None)
        is_draw = packet in DRAWS
        if func in TO_PYTHON or (not is_draw and not self._drawn):  # most steps draw nothing to follow
            return
        self._ranges.note(func, args, out)
        # a comparison that every value of a uniform draw answers alike (``rand([]) < 0.0``) is no draw's
        constant = self._ranges.answer(func, args) is not None
        inputs = _tensors((args, kwargs))
        drawn = not constant and (is_draw or (bool(inputs) and all(t in self._drawn for t in inputs)))
        schema = getattr(func, "_schema", None)
        written = [] if schema is None else [
            a for a, arg in zip(args, schema.arguments, strict=False)
            if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
        for t in [*_tensors(out), *written]:
            if drawn:
                self._drawn[t] = None
            else:
                self._drawn.pop(t, None)


def refusal(message: str, where: str) -> str:
    """A fake step's refusal of a call (``message``) that turned a drawn tensor into a Python value."""
    return f"{message.split(';')[0]}: {where or 'the model'} branches on a random draw; {ADVICE}"
