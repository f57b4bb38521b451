"""A step whose forward ops differ from the profiled graph's where the plan decides nothing trains; where
the plan decides something there, it is refused naming the module and the tensor (executor/resync.py).

The model is a tiny attention stack whose causal mask, read by every block, is built one of two ways with
the same values (as transformers builds it differently for padded and unpadded batches), and whose blocks
can compute their activation another way. The plan recomputes each block's softmax and activation: a
replay of the softmax re-runs the product with the mask, so the mask is a tensor every replay reads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memplan.executor import apply
from memplan.planner.core.boundaries import boundary_positions
from memplan.planner.core.errors import PlanMismatch
from memplan.planner.core.graph import Graph
from memplan.planner.core.plan import Action, Plan
from memplan.planner.probe.profiler import profile

pytestmark = pytest.mark.usefixtures("one_thread")


class Mask(nn.Module):
    """A causal mask, as ``tril`` of ones or (``alt``) as a comparison of positions: equal values; with
    ``alt="batched"`` one copy per sequence (the same products, four times the bytes)."""

    def __init__(self):
        super().__init__()
        self.alt: bool | str = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.alt:
            i = torch.arange(t)
            m = (i[:, None] >= i[None, :]).to(x.dtype)
            return m.expand(x.shape[0], t, t).contiguous() if self.alt == "batched" else m
        return torch.ones(t, t, dtype=x.dtype).tril()


class Block(nn.Module):
    """Masked self-attention without heads; ``alt`` computes tanh through the sigmoid."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.alt = False

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(x @ x.transpose(1, 2) * m, -1)
        y = self.proj(p @ x)
        h = 2 * torch.sigmoid(2 * y) - 1 if self.alt else torch.tanh(y)
        return x + h


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mask = Mask()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        m = self.mask(x)
        for b in self.blocks:
            x = b(x, m)
        return self.head(x)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def _setup() -> tuple[Net, Graph, Plan]:
    torch.manual_seed(0)
    model = Net()
    graph = profile(copy.deepcopy(model), _batch(), _loss, repeats=1, progress=False, measure=False)
    moved = {op.outputs[0]: Action.RECOMPUTE for op in graph.ops
             if op.name in ("aten._softmax.default", "aten.tanh.default")}
    assert len(moved) == 6
    return model, graph, Plan.for_graph(graph, moved)


def _train(model: Net, steps: list[dict], executor=None) -> list[torch.Tensor]:
    """One step per entry: which modules run their ``alt`` path; an entry with ``refused`` expects the
    step's forward refused (and retries it on the profiled path)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ex = apply(model, executor[1], graph=executor[0], optimizer=opt) if executor else None
    losses = []
    try:
        for step in steps:
            model.mask.alt = step.get("mask", False)
            for b in model.blocks:
                b.alt = step.get("block", False)
            opt.zero_grad(set_to_none=True)
            if step.get("refused") and ex is not None:
                with pytest.raises(PlanMismatch, match=step["refused"]):
                    _loss(model, _batch())
                assert _get_current_dispatch_mode() is None  # nothing of the executor is left active
                model.mask.alt = False
                for b in model.blocks:
                    b.alt = False
                opt.zero_grad(set_to_none=True)
            loss = _loss(model, _batch())
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if ex is not None:
                assert ex.last_step.replays > 0  # the plan's recomputation ran
                assert (ex.last_step.resyncs > 0) == model.mask.alt  # the ops differed, and only then
    finally:
        if ex is not None:
            ex.remove()
    return losses


def _without_module_calls(graph: Graph) -> Graph:
    """The graph as a file from before graphs recorded their module calls has it."""
    data = graph.model_dump()
    del data["module_calls"]
    return Graph.from_dict(data)


def test_a_graph_without_module_calls_loads_and_derives_them_from_its_ops():
    """Each module of the model runs its ops in one call (no module is called back to back), so the calls
    derived from the ops' module paths are the recorded ones, and one more: the ``blocks`` list, which is
    never called (its path is on its blocks' ops), whose boundaries a step never meets."""
    _, graph, _ = _setup()
    old = _without_module_calls(graph)
    assert old.module_calls == [] and old.fingerprint == graph.fingerprint
    assert len(graph.module_calls) == 1 + 1 + 1 + 3 * 2 + 1  # the root, emb, mask, blocks and their proj, head
    recorded, derived = boundary_positions(graph), boundary_positions(old)
    assert {key: derived.get(key) for key in recorded} == recorded
    assert {path for path, _, _ in set(derived) - set(recorded)} == {"blocks"}


@pytest.mark.parametrize("calls", ["recorded", "derived"])
def test_mask_built_another_way_trains_bitwise_like_plain_training(calls):
    """The mask built another way than profiled, in the first step (which learns the fast path) and in
    later ones: the replays read the model's own mask, and training is plain training's, bitwise; with a
    graph that recorded its module calls, or one from before they were recorded."""
    model, graph, plan = _setup()
    if calls == "derived":
        graph = _without_module_calls(graph)
    steps = [{"mask": True}, {}, {"mask": True}, {"mask": True}]
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    losses = _train(planned, steps, (graph, plan))
    expected = _train(plain, steps)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))


def test_a_planned_tensor_made_another_way_is_refused_naming_module_and_tensor():
    """Blocks computing their (recomputed) activation another way: refused, in the first step and on the
    fast path, naming the block and the tensor; so is a mask of other bytes, which the replays read. The
    retried step trains, and training ends where plain training on the profiled path ends."""
    model, graph, plan = _setup()
    tanh = next(op for op in graph.ops if op.name == "aten.tanh.default")
    mask = next(op for op in graph.ops if op.name == "aten.tril.default").outputs[0]
    other_bytes = (rf"module mask: tensor {mask} \(float32\[8, 8\], which a replay reads\) is made by op \d+ "
                   rf"\(aten\.tril\.default\), which did not run as profiled, and read by op \d+ "
                   rf"\(aten\.mul\.Tensor\) as 1024 B, not the profiled 256 B: forward op 1 differs from the "
                   rf"profiled graph: the plan expects aten\.ones\.default \(module mask\), the model ran "
                   rf"aten\.arange\.default; re-profile")
    refused = (rf"module blocks\.0: tensor {tanh.outputs[0]} \(float32\[4, 8, 16\], which the plan marks "
               rf"recompute\) is made by op {tanh.id} \(aten\.tanh\.default\), which did not run as profiled: "
               rf"forward op \d+ differs from the profiled graph: the plan expects aten\.tanh\.default "
               rf"\(module blocks\.0\), the model ran aten\.mul\.Tensor; the step re-synchronised at the end "
               rf"of module blocks\.0 \(call 0\)")
    steps = [{"block": True, "refused": refused}, {}, {"block": True, "mask": True, "refused": refused},
             {"mask": "batched", "refused": other_bytes}, {}]
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    _train(planned, steps, (graph, plan))
    _train(plain, [{}] * len(steps))
    assert all(torch.equal(a, b) for a, b in zip(planned.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("profiled", ["unpadded", "padded"])
def test_padded_and_unpadded_batches_under_sdpa_share_one_plan(profiled):
    """transformers' ``sdpa`` attention skips the mask for an unpadded batch and, with a padded one, builds
    it and turns it into a float mask inside every attention (other ops than the profiled step's, before
    and between the tensors the plan recomputes). Profiled on either, a tiny GPT-2 (dropout on) trains a
    mix of both under one plan bitwise like plain training, replaying in every step."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from memplan.solvers import keep_all_report, solve

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     attn_implementation="sdpa")
    base = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    padded = torch.ones_like(ids)
    padded[1, 10:] = 0
    masks = {"unpadded": torch.ones_like(ids), "padded": padded}

    def loss_fn(model, mask):
        return model(input_ids=ids, attention_mask=mask, labels=ids).loss

    graph = profile(copy.deepcopy(base), masks[profiled], loss_fn, repeats=1, progress=False, measure=False)
    plan = solve(graph, int(keep_all_report(graph).peak_bytes * 0.85), "dp", time_limit_s=1.0).plan
    assert plan.count(Action.RECOMPUTE) > 0

    def train(model, planned: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)  # dropout draws the same numbers in both runs
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ex = apply(model, plan, graph=graph, optimizer=opt) if planned else None
        losses = []
        for which in ("unpadded", "padded", "padded", "unpadded"):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, masks[which])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            assert ex is None or ex.last_step.replays > 0
            assert ex is None or (ex.last_step.resyncs > 0) == (which != profiled)  # the ops differed
        if ex is not None:
            ex.remove()
        return losses

    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert all(torch.equal(x, y) for x, y in zip(train(a, True), train(b, False), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
