"""Shape families: one graph for every batch shape of a training step (torch-free).

A graph is profiled at one shape of the batch. Profiled at a few more (the same model, the same step,
smaller values of the batch's *dynamic dimensions*: ``batch``, ``seq``, ...), every size in it is fitted
exactly as a polynomial in those dimensions: each tensor's shape entries and storage bytes, each op's
measured byte figures, the batch's bytes. :func:`fit_family` does it and returns the largest shape's graph
with the family in ``graph.meta["shape_family"]``; :func:`at_shape` evaluates it at any shape; the
executor checks each tensor a step creates against it (:class:`ShapeMatcher`).

**Fitting.** A quantity's values at the profiled points are fitted by the *sparsest* polynomial (fewest
terms, then lowest degree; each dimension's exponent at most 2, which covers attention's ``seq**2``) that
reproduces all of them exactly, in rational arithmetic, with strictly more points than terms: every fit is
confirmed by at least one profile it was not solved from. A storage whose bytes are its tensor's elements
times the element size at every point gets the product of its entries' polynomials (exact by construction);
other storages fit their bytes directly. An op's measured scratch figures (kernel workspace, gradient
bytes) that no polynomial fits, or that fit only with a term that shrinks as the shape grows (allocator
noise fitted exactly), are taken as their largest profiled value, constant: an upper bound for shapes no
larger than the profiled ones (past them, as :mod:`memplan.solvers.maxbatch` evaluates, it may not be). A shape entry or a storage's bytes that no polynomial fits is an
error naming the tensor (:class:`GraphError`): the family cannot describe it.

**Time model.** An op's forward and backward times at a shape are its times at the largest profiled shape
scaled by ``r``, the ratio of the bytes of its largest activation operand (input or output) at that shape
to those at the largest shape (``r = 1`` for an op that touches no activation). For matrix products and
attention (work proportional to the largest operand) and for element-wise ops (proportional to bytes)
this is the work's own scaling; for small ops whose time is launch overhead it under-estimates their
time at small shapes. The optimizer's time (parameters only) does not scale.

**Structure.** Every profiled graph must have the same ops and tensors in the same order, with the same
edges, saved tensors and lifetimes: a model that branches on a dynamic dimension (a different op sequence
at another length) cannot be one family, and :func:`fit_family` says where the graphs part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from itertools import combinations, product
from math import prod
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from memplan.planner.core.devicespec import round_allocation
from memplan.planner.core.errors import GraphError
from memplan.planner.core.graph import Graph

FAMILY_KEY = "shape_family"
FAMILY_FORMAT = "memplan.shapes/1"
MAX_EXPONENT = 2          # per dimension: seq**2 (attention scores) is the highest power seen in practice
MAX_TERMS = 4
OP_BYTE_FIELDS = ("workspace_bytes", "backward_workspace_bytes", "backward_grad_alloc_bytes",
                  "backward_grad_free_bytes")

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1}

# A polynomial as JSON: [[coefficient, [exponent per dimension]], ...]; a coefficient is an int or "p/q".
PolyJSON = list[list[Any]]
Point = dict[str, int]


class Poly:
    """An exact polynomial in the family's dimensions: ``((coefficient, exponents), ...)``."""

    __slots__ = ("terms",)

    def __init__(self, terms: Sequence[tuple[Fraction, tuple[int, ...]]]):
        self.terms = tuple((Fraction(c), tuple(e)) for c, e in terms if c != 0)

    def __call__(self, values: Sequence[int]) -> Fraction:
        return sum((c * prod(v ** k for v, k in zip(values, e, strict=True)) for c, e in self.terms),
                   Fraction(0))

    def __mul__(self, other: Poly) -> Poly:
        out: dict[tuple[int, ...], Fraction] = {}
        for c1, e1 in self.terms:
            for c2, e2 in other.terms:
                e = tuple(a + b for a, b in zip(e1, e2, strict=True))
                out[e] = out.get(e, Fraction(0)) + c1 * c2
        return Poly([(c, e) for e, c in sorted(out.items())])

    def scale(self, k: int) -> Poly:
        return Poly([(c * k, e) for c, e in self.terms])

    def free(self) -> set[int]:
        """Indices of the dimensions it depends on."""
        return {i for _, e in self.terms for i, k in enumerate(e) if k}

    def to_json(self) -> PolyJSON:
        return [[c.numerator if c.denominator == 1 else f"{c.numerator}/{c.denominator}", list(e)]
                for c, e in self.terms]

    @classmethod
    def from_json(cls, data: PolyJSON, n_dims: int) -> Poly:
        terms = []
        for c, e in data:
            if len(e) != n_dims or any((not isinstance(k, int)) or k < 0 for k in e):
                raise ValueError(f"polynomial term {[c, e]} does not have {n_dims} non-negative exponents")
            terms.append((Fraction(c), tuple(e)))
        return cls(terms)

    def show(self, dims: Sequence[str]) -> str:
        if not self.terms:
            return "0"
        parts = []
        for c, e in self.terms:
            mono = "*".join(d if k == 1 else f"{d}^{k}" for d, k in zip(dims, e, strict=True) if k)
            parts.append(str(c) if not mono else mono if c == 1 else f"{c}*{mono}")
        return " + ".join(parts)


class ShapeFamily(BaseModel):
    """``graph.meta["shape_family"]``: how each size of the graph depends on the dynamic dimensions."""

    model_config = ConfigDict(extra="forbid")

    format: str = FAMILY_FORMAT
    dims: list[str] = Field(min_length=1, description="names of the dynamic dimensions, e.g. ['batch', 'seq']")
    at: Point = Field(description="the dimensions' values of the graph these sizes describe (its own shape)")
    limit: Point = Field(description="the largest values the executor accepts with a plan for this graph")
    points: list[Point] = Field(description="the profiled shapes the polynomials were fitted at")
    tensor_shape: list[list[PolyJSON]]
    tensor_bytes: list[PolyJSON]
    op_bytes: dict[str, list[PolyJSON]]
    inputs_bytes: PolyJSON

    _parsed: dict[int, tuple[list[Poly], Poly]] = PrivateAttr(default_factory=dict)

    def polys(self, tid: int) -> tuple[list[Poly], Poly]:
        """Tensor ``tid``'s shape entries and bytes as polynomials (parsed once per family object)."""
        got = self._parsed.get(tid)
        if got is None:
            n = len(self.dims)
            got = ([Poly.from_json(e, n) for e in self.tensor_shape[tid]], Poly.from_json(self.tensor_bytes[tid], n))
            self._parsed[tid] = got
        return got

    def values(self, point: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(int(point[d]) for d in self.dims)

    def show(self, point: Mapping[str, int]) -> str:
        return ", ".join(f"{d}={point[d]}" for d in self.dims if d in point)


def family_of(graph: Graph) -> ShapeFamily | None:
    """The graph's shape family, or None when it was profiled at one shape only. Raises
    :class:`GraphError` when ``meta["shape_family"]`` is malformed."""
    data = graph.meta.get(FAMILY_KEY)
    if data is None:
        return None
    try:
        fam = ShapeFamily.model_validate(data)
    except ValidationError as e:
        raise GraphError(f"graph {graph.name}: meta.shape_family is malformed: {e.errors()[0]['msg']}") from None
    if len(fam.tensor_shape) != len(graph.tensors) or len(fam.tensor_bytes) != len(graph.tensors):
        raise GraphError(f"graph {graph.name}: meta.shape_family describes {len(fam.tensor_bytes)} tensors, "
                         f"the graph has {len(graph.tensors)}")
    return fam


# ---- fitting -----------------------------------------------------------------------------------------------


def _solve_exact(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """The unique solution of the over- or exactly determined system ``rows @ x = rhs`` (Gauss-Jordan in
    rationals), or None when it has none or more than one."""
    n = len(rows[0])
    m = [list(r) + [b] for r, b in zip(rows, rhs, strict=True)]
    r = 0
    for col in range(n):
        pivot = next((i for i in range(r, len(m)) if m[i][col] != 0), None)
        if pivot is None:
            return None  # rank-deficient: the points cannot tell these terms apart
        m[r], m[pivot] = m[pivot], m[r]
        inv = 1 / m[r][col]
        m[r] = [x * inv for x in m[r]]
        for i in range(len(m)):
            if i != r and m[i][col] != 0:
                f = m[i][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[r], strict=True)]
        r += 1
    if any(row[-1] != 0 for row in m[r:]):
        return None  # inconsistent: no polynomial on these terms fits every point
    return [m[i][-1] for i in range(n)]


class _Fitter:
    """Fits value vectors over fixed points; memoised (most tensors share a handful of size patterns)."""

    def __init__(self, points: list[tuple[int, ...]]):
        self.points = points
        k = len(points[0])
        monomials = sorted(product(range(MAX_EXPONENT + 1), repeat=k), key=lambda e: (sum(e), max(e), e))
        self.monomials = monomials
        self.cache: dict[tuple[int, ...], Poly | None] = {}

    def fit(self, values: Sequence[int]) -> Poly | None:
        key = tuple(values)
        if key in self.cache:
            return self.cache[key]
        out = self._fit(key)
        self.cache[key] = out
        return out

    def _fit(self, values: tuple[int, ...]) -> Poly | None:
        if all(v == 0 for v in values):
            return Poly(())
        if len(set(values)) == 1:
            return Poly([(Fraction(values[0]), self.monomials[0])])
        rhs = [Fraction(v) for v in values]
        n_points = len(self.points)
        for size in range(1, min(MAX_TERMS, n_points - 1) + 1):  # more points than terms: a check
            for subset in combinations(self.monomials, size):
                rows = [[Fraction(prod(v ** k for v, k in zip(p, e, strict=True))) for e in subset]
                        for p in self.points]
                coef = _solve_exact(rows, rhs)
                if coef is not None and all(c != 0 for c in coef):
                    return Poly(list(zip(coef, subset, strict=True)))
        return None


def _structure(g: Graph) -> tuple[list[tuple], list[tuple]]:
    ops = [(o.name, o.module, tuple(o.inputs), tuple(o.outputs), tuple(o.saved), o.has_backward, o.random)
           for o in g.ops]
    tensors = [(t.kind, t.producer, t.output_index, t.dtype, len(t.shape), t.requires_grad, t.freed_after,
                t.held_by_caller, t.recomputable, tuple(t.rebuilt_by)) for t in g.tensors]
    return ops, tensors


def _first_difference(a: Graph, b: Graph, pa: str, pb: str) -> str:
    ops_a, ten_a = _structure(a)
    ops_b, ten_b = _structure(b)
    for k, (x, y) in enumerate(zip(ops_a, ops_b, strict=False)):
        if x != y:
            where = f"{x[0]} (module {x[1] or '?'})" if x[0] == y[0] else f"{x[0]} at {pa}, {y[0]} at {pb}"
            return f"op {k} differs: {where}"
    if len(ops_a) != len(ops_b):
        return f"{len(ops_a)} ops at {pa}, {len(ops_b)} at {pb}"
    for t, (x, y) in enumerate(zip(ten_a, ten_b, strict=False)):
        if x != y:
            return f"tensor {t} differs (kind, producer, dtype, rank or lifetime)"
    return f"{len(ten_a)} tensors at {pa}, {len(ten_b)} at {pb}"


def _itemsize(dtype: str) -> int | None:
    return _ITEMSIZE.get(dtype)


def _growing(poly: Poly, n_dims: int) -> bool:
    """Non-negative at every dimension 1 and non-decreasing in each: every non-constant coefficient >= 0."""
    return all(c >= 0 for c, e in poly.terms if any(e)) and poly((1,) * n_dims) >= 0


def fit_family(graphs: Sequence[tuple[Mapping[str, int], Graph]]) -> Graph:
    """The family of ``graphs``, each profiled at the dynamic dimensions' values given beside it.

    Every graph must name the same dimensions; the first is the largest (no dimension larger elsewhere)
    and is returned, as a copy, with ``meta["shape_family"]`` set and ``limit`` its own shape. Raises
    :class:`GraphError` when the graphs differ in structure (naming the first op or tensor that does),
    when the points cannot determine the sizes (fewer than two, or a size no polynomial fits, naming the
    tensor), or when the first graph is not the largest.
    """
    if len(graphs) < 2:
        raise GraphError("a shape family needs graphs profiled at two or more shapes")
    dims = list(graphs[0][0])
    if not dims:
        raise GraphError("a shape family needs at least one dynamic dimension")
    for point, _ in graphs:
        if sorted(point) != sorted(dims):
            raise GraphError(f"every profiled shape must give the same dimensions {dims}, got {sorted(point)}")
        if any((not isinstance(point[d], int)) or point[d] < 1 for d in dims):
            raise GraphError(f"dimension values must be positive integers, got {dict(point)}")
    points = [tuple(int(p[d]) for d in dims) for p, _ in graphs]
    if len(set(points)) != len(points):
        raise GraphError(f"the profiled shapes must differ, got {[dict(p) for p, _ in graphs]}")
    top = points[0]
    if any(any(v > t for v, t in zip(p, top, strict=True)) for p in points[1:]):
        raise GraphError("the first profiled shape must be the largest (no dimension larger in another)")
    for d_i, d in enumerate(dims):
        if len({p[d_i] for p in points}) < 2:
            raise GraphError(f"dimension {d!r} has the same value at every profiled shape; profile another")
    names = [", ".join(f"{d}={v}" for d, v in zip(dims, p, strict=True)) for p in points]
    base = graphs[0][1]
    ref = _structure(base)
    for (_, g), name in zip(graphs[1:], names[1:], strict=True):
        if _structure(g) != ref:
            raise GraphError(f"the step differs between {names[0]} and {name}: "
                             f"{_first_difference(base, g, names[0], name)}; the model branches on a dynamic "
                             f"dimension, and one plan cannot cover both shapes")
    fitter = _Fitter(points)
    gs = [g for _, g in graphs]

    tensor_shape: list[list[PolyJSON]] = []
    tensor_bytes: list[PolyJSON] = []
    for t_i, info in enumerate(base.tensors):
        entries = []
        for j in range(len(info.shape)):
            poly = fitter.fit([g.tensors[t_i].shape[j] for g in gs])
            if poly is None:
                raise GraphError(f"tensor {t_i} ({info.kind}, {info.dtype}{info.shape}): dimension {j} "
                                 f"({[g.tensors[t_i].shape[j] for g in gs]} at {names}) is no polynomial of "
                                 f"at most {MAX_TERMS} terms in {', '.join(dims)}; profile at other shapes")
            entries.append(poly)
        size = _itemsize(info.dtype)
        # a CUDA graph charges every storage as the caching allocator does (rounded up to 512 bytes): the
        # family keeps the elements' bytes, exact, and charges them where it is evaluated
        exact = size is not None and all(
            g.tensors[t_i].bytes == round_allocation(size * prod(g.tensors[t_i].shape), g.device) for g in gs)
        if exact:
            nbytes = Poly([(Fraction(size), (0,) * len(dims))])
            for e in entries:
                nbytes = nbytes * e
        else:
            nbytes = fitter.fit([g.tensors[t_i].bytes for g in gs])
            if nbytes is None:
                raise GraphError(f"tensor {t_i} ({info.kind}, {info.dtype}{info.shape}): its bytes "
                                 f"({[g.tensors[t_i].bytes for g in gs]} at {names}) are no polynomial in "
                                 f"{', '.join(dims)}; profile at other shapes")
        tensor_shape.append([e.to_json() for e in entries])
        tensor_bytes.append(nbytes.to_json())

    def measured(values: list[int]) -> PolyJSON:
        poly = fitter.fit(values)
        if poly is None or not _growing(poly, len(dims)):
            # allocator scratch that no polynomial fits, or fits only by shrinking as the shape grows (noise
            # fitted exactly): its largest value bounds it up to the largest profiled shape
            poly = Poly([(Fraction(max(values)), (0,) * len(dims))])
        return poly.to_json()

    op_bytes = {f: [measured([getattr(g.ops[k], f) for g in gs]) for k in range(len(base.ops))]
                for f in OP_BYTE_FIELDS}
    inputs_bytes = measured([g.fixed.inputs_bytes for g in gs])
    at = dict(zip(dims, top, strict=True))
    family = ShapeFamily(dims=dims, at=at, limit=at, points=[dict(zip(dims, p, strict=True)) for p in points],
                         tensor_shape=tensor_shape, tensor_bytes=tensor_bytes, op_bytes=op_bytes,
                         inputs_bytes=inputs_bytes)
    out = base.model_copy(deep=True)
    out.meta = {**out.meta, FAMILY_KEY: family.model_dump(mode="json")}
    return out.invalidate()


# ---- evaluating --------------------------------------------------------------------------------------------


def _int(poly: Poly, values: tuple[int, ...], what: str, point: str) -> int:
    v = poly(values)
    if v.denominator != 1 or v < 0:
        raise GraphError(f"{what} is {v} at {point}: not a size; this shape is outside the profiled family")
    return int(v)


def at_shape(graph: Graph, point: Mapping[str, int], *, extrapolate: bool = False) -> Graph:
    """``graph`` (with a shape family) evaluated at ``point`` (a value for every dynamic dimension): every
    tensor's shape and bytes, every op's byte figures and the batch's bytes from the polynomials, the times
    scaled as the module docstring says. The copy's family has ``at`` and ``limit`` set to ``point``, so
    a plan solved for it applies to shapes up to ``point``.

    Raises :class:`GraphError` when the graph has no family, a dimension is missing or unknown, a value
    is not a positive integer, a size is not a whole number there, or (unless ``extrapolate``) a value is
    above the largest profiled one.
    """
    fam = family_of(graph)
    if fam is None:
        raise GraphError(f"graph {graph.name} was profiled at one shape; profile a shape family "
                         f"(memplan.planner.probe.family.profile_family) to evaluate it at others")
    if sorted(point) != sorted(fam.dims):
        raise GraphError(f"a shape of graph {graph.name} gives {', '.join(fam.dims)}; got {', '.join(point) or 'none'}")
    for d in fam.dims:
        v = point[d]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise GraphError(f"dimension {d} must be a positive integer, got {v!r}")
        if not extrapolate and v > fam.limit[d]:
            raise GraphError(f"{d}={v} is above the largest profiled {d}={fam.limit[d]}")
    n = len(fam.dims)
    values = fam.values(point)
    base = fam.values(fam.at)
    label = fam.show(point)
    out = graph.model_copy(deep=True)
    new_bytes: list[int] = []
    for t, info in enumerate(out.tensors):
        info.shape = [_int(Poly.from_json(e, n), values, f"tensor {t} dimension {j}", label)
                      for j, e in enumerate(fam.tensor_shape[t])]
        info.bytes = round_allocation(_int(Poly.from_json(fam.tensor_bytes[t], n), values, f"tensor {t}'s bytes",
                                           label), graph.device)
        new_bytes.append(info.bytes)
    old_bytes = [t.bytes for t in graph.tensors]
    for k, op in enumerate(out.ops):
        for f in OP_BYTE_FIELDS:
            setattr(op, f, _int(Poly.from_json(fam.op_bytes[f][k], n), values, f"op {k}'s {f}", label))
        acts = [t for t in (*op.inputs, *op.outputs) if graph.tensors[t].kind == "activation"]
        if acts:
            biggest = max(acts, key=lambda t: old_bytes[t])
            r = new_bytes[biggest] / old_bytes[biggest] if old_bytes[biggest] else 1.0
            op.time_s *= r
            op.backward_time_s *= r
    out.fixed.inputs_bytes = _int(Poly.from_json(fam.inputs_bytes, n), values, "the batch's bytes", label)
    if values != base:
        out.measured = type(out.measured)()  # measured at another shape: not this one's
    here = dict(zip(fam.dims, values, strict=True))
    out.meta = {**out.meta, FAMILY_KEY: fam.model_copy(update={"at": here, "limit": here}).model_dump(mode="json")}
    return out.invalidate()


# ---- matching a running step ------------------------------------------------------------------------------


class ShapeMatcher:
    """Checks the tensors a step creates against a graph's family, binding the dimensions as they appear.

    One per step: ``check(tid, dtype, shape, nbytes)`` returns None when tensor ``tid`` has the shape and
    bytes the family gives it at the dimensions bound so far (binding those its entries reveal), at no
    more than the family's ``limit``; otherwise a one-line reason naming the tensor and both shapes.
    """

    def __init__(self, family: ShapeFamily, graph: Graph):
        self.fam = family
        self.graph = graph
        self.n = len(family.dims)
        self.bound: dict[int, int] = {}  # dimension index -> value this step
        self.limit = family.values(family.limit)

    def _bind(self, polys: list[Poly], shape: list[int]) -> None:
        """Bind each dimension that is the only unbound one of an entry linear in it."""
        progress = True
        while progress:
            progress = False
            for poly, observed in zip(polys, shape, strict=True):
                free = poly.free() - set(self.bound)
                if len(free) != 1:
                    continue
                (d,) = free
                # poly = a * d + b with the bound dimensions substituted (linear in d, or skip)
                if any(e[d] > 1 for _, e in poly.terms):
                    continue
                vals0 = tuple(self.bound.get(i, 0) if i != d else 0 for i in range(self.n))
                vals1 = tuple(self.bound.get(i, 0) if i != d else 1 for i in range(self.n))
                b = poly(vals0)
                a = poly(vals1) - b
                if a == 0:
                    continue
                v = (observed - b) / a
                if v.denominator == 1 and v >= 1:
                    self.bound[d] = int(v)
                    progress = True

    def _describe(self, values: dict[int, int]) -> str:
        return ", ".join(f"{self.fam.dims[i]}={v}" for i, v in sorted(values.items()))

    def check(self, tid: int, dtype: str, shape: list[int], nbytes: int) -> str | None:
        """``nbytes``: the storage's own ``nbytes()``; compared as the graph's device charges it (a family
        of a CUDA graph holds the elements' bytes, the graph the allocator's rounded ones)."""
        info = self.graph.tensors[tid]
        device = self.graph.device
        polys, nbytes_poly = self.fam.polys(tid)
        if dtype != info.dtype or len(shape) != len(polys):
            return (f"tensor {tid} is {dtype}{shape}; the profiled family has {info.dtype}{info.shape} "
                    f"(another dtype or rank)")
        self._bind(polys, shape)
        over = {i: v for i, v in self.bound.items() if v > self.limit[i]}
        if over:
            return (f"tensor {tid} is {dtype}{shape} ({self._describe(over)}); the plan's graph has "
                    f"{info.dtype}{info.shape}, its largest shape ({self.fam.show(self.fam.limit)})")
        if set().union(*(p.free() for p in polys), nbytes_poly.free()) - set(self.bound):
            # dimensions not yet revealed: the tensor must at least be no larger than the graph's
            if round_allocation(nbytes, device) > info.bytes or any(
                    s > g for s, g in zip(shape, info.shape, strict=True)):
                return (f"tensor {tid} is {dtype}{shape} ({nbytes} B); the plan's graph has at most "
                        f"{info.dtype}{info.shape} ({info.bytes} B)")
            return None
        values = tuple(self.bound.get(i, 0) for i in range(self.n))
        expect = [p(values) for p in polys]
        want = nbytes_poly(values)
        charged = round_allocation(nbytes, device)
        if [Fraction(s) for s in shape] != expect or (
                Fraction(nbytes) != want and (want.denominator != 1 or charged != round_allocation(int(want), device))):
            shown = [int(e) if e.denominator == 1 else float(e) for e in expect]
            return (f"tensor {tid} is {dtype}{shape} ({nbytes} B); at {self._describe(self.bound)} the "
                    f"profiled family has {info.dtype}{shown} ({nbytes_poly(values)} B): this shape is "
                    f"outside the family")
        if charged > info.bytes:  # a size that is not monotone in the dimensions: the plan's bytes would not hold
            return (f"tensor {tid} is {dtype}{shape} ({nbytes} B) at {self._describe(self.bound)}, more than the "
                    f"{info.bytes} B it has at the plan's graph's shape ({self.fam.show(self.fam.limit)})")
        return None

