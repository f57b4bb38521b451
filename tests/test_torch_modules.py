"""torch.nn's own layers, not transformers': the fake trace is the real step, and a plan that recomputes
inside each layer trains bitwise as plain training does (issue #21's matrix, for models written with
``nn.LSTM``, ``nn.TransformerEncoder``, ``nn.Transformer``, ``nn.MultiheadAttention``, 2-D CNNs in channels-last,
``nn.EmbeddingBag``, ``F.unfold``, parametrizations, CPU autocast to bfloat16...).

``nn.LSTM`` on a CPU failed three ways before the fixes here. Its fake profile crashed the process: the
isolated timing of oneDNN's backward (``mkldnn_rnn_layer_backward``) read a workspace of zeros and
segfaulted (planner/probe/workspaces.py rebuilds it with the forward). The fake graph had the forward's
workspace as ``uint8[0]``, the meta function's size, where oneDNN makes 335,872 B (fake.py
``KERNEL_SHAPES``: the kernel runs on zeros). And a replay of the layer made no workspace at all: the
executor replayed under ``no_grad``, where the kernel skips it; replays now run in grad mode, below
autograd (as the forward ran, building no graph).
"""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memplan.executor import apply
from memplan.planner.core.schedule import schedule
from memplan.planner.core.simulator import simulate
from memplan.planner.probe.optime import OpTimer
from memplan.planner.probe.profiler import profile
from memplan.solvers import memory_lower_bound, solve

pytestmark = pytest.mark.usefixtures("one_thread")


class Recurrent(nn.Module):
    def __init__(self, kind: str, bidirectional: bool = False):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 24, num_layers=2, batch_first=True, dropout=0.1,
                                     bidirectional=bidirectional)
        self.head = nn.Linear(24 * (2 if bidirectional else 1), 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, x):
        return self.head(self.enc(self.emb(x), is_causal=True,
                                  mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1])))


class Signal(nn.Module):
    """1-D convolutions with group and batch norm (running statistics: a replay must not move them twice)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(4, 16, 5, padding=2), nn.GroupNorm(4, 16), nn.GELU(),
                                 nn.Conv1d(16, 16, 3, dilation=2, padding=2), nn.BatchNorm1d(16),
                                 nn.ReLU(inplace=True), nn.AdaptiveAvgPool1d(4), nn.Flatten(), nn.Linear(64, 5))

    def forward(self, x):
        return self.net(x)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(200, 16, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x):
        return self.mlp(self.bag(x))


class Parametrized(nn.Module):
    """Weight and spectral norm: each weight is computed from its parametrization in every forward (spectral
    norm's power iteration writes its ``_u`` / ``_v`` buffers)."""

    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(16, 32))
        self.b = nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32))
        self.c = nn.Linear(32, 5)

    def forward(self, x):
        return self.c(F.mish(self.b(F.softplus(self.a(x)))))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` returning its averaged weights too (``need_weights=True``, the default)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.att = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        h = self.emb(x)
        a, w = self.att(h, h, h)
        return self.head(a[:, -1] + w.sum(1)[:, :1])


class Seq2Seq(nn.Module):
    """``nn.Transformer``: encoder and decoder, a causal target mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.t = nn.Transformer(32, 4, 1, 1, 64, 0.1, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        e = self.emb(x)
        return self.head(self.t(e, e[:, :8], tgt_mask=nn.Transformer.generate_square_subsequent_mask(8))[:, -1])


class Vision(nn.Module):
    """A classic CNN: 2-D convolutions, batch norm, max pooling, channel dropout."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Dropout2d(0.1), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 5))

    def forward(self, x):
        return self.net(x)


class Patches(nn.Module):
    """Bilinear, pixel shuffle, ``F.unfold`` (its backward's gradient lives in a larger storage on a CPU:
    fake.py ``STORAGE_OF_INPUT``), ``cdist``, ``topk`` and ``gather``, ``einsum``, after an embedding with
    ``max_norm``, which renormalises its weight in place in every forward."""

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.bil = nn.Bilinear(8, 8, 16)
            self.shuffle = nn.PixelShuffle(2)

        def forward(self, e):
            img = self.shuffle(self.bil(e, e.flip(1)).view(-1, 16, 1, 1).repeat(1, 1, 2, 2))
            u = F.unfold(img.tanh(), 2).mean(-1)
            d = torch.cdist(u.unsqueeze(0), u.unsqueeze(0)).squeeze(0).mean(1, keepdim=True)
            _, top = u.topk(4, dim=1)
            return torch.einsum("nk,nk->nk", u, u) + d + torch.gather(u, 1, top).sum(1, keepdim=True)

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8, padding_idx=0, max_norm=1.0)
        self.body = self.Body()
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(self.emb(x).mean(1)))


class PackedRecurrent(nn.Module):
    """A GRU over padded sequences packed by their lengths (``pack_padded_sequence``: its kernel reads the
    lengths, a real tensor in the fake trace; timed alone on made-up ones it failed, and the fake graph lost
    its scratch: optime.py keeps a small real argument's values)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        lengths = torch.tensor([12, 10, 7, 3])
        _, h = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
        return self.head(h[-1])


class Autocast(nn.Module):
    """``inner`` under CPU autocast to bfloat16 (what a Trainer's ``bf16=True`` does on a CPU): its linear
    and convolution outputs are bfloat16 and reach the float32 weights of its LayerNorm, GroupNorm and
    BatchNorm, whose CPU kernels then keep their statistics in float32 (fake.py ``MIXED_DTYPE_STATS``)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def _classes(n: int) -> torch.Tensor:
    return torch.randint(0, 5, (n,))


# name -> (model, batch, the module a manual plan checkpoints)
CASES = {
    "lstm": (lambda: Recurrent("LSTM"), lambda: (torch.randn(4, 12, 16), _classes(4)), "rnn"),
    "lstm_bidirectional": (lambda: Recurrent("LSTM", True), lambda: (torch.randn(4, 12, 16), _classes(4)), "rnn"),
    "gru": (lambda: Recurrent("GRU"), lambda: (torch.randn(4, 12, 16), _classes(4)), "rnn"),
    "transformer_encoder": (Encoder, lambda: (torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4 * 16,))),
                            "enc"),
    "conv1d_norms": (Signal, lambda: (torch.randn(4, 4, 32), _classes(4)), "net"),
    "mlp_layer_norm_bf16_autocast": (lambda: Autocast(nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
                                                                    nn.Linear(32, 32), nn.LayerNorm(32),
                                                                    nn.Linear(32, 5))),
                                     lambda: (torch.randn(8, 16), _classes(8)), "inner"),
    "gru_packed_sequences": (PackedRecurrent, lambda: (torch.randn(4, 12, 8), _classes(4)), "rnn"),
    "multihead_attention_weights": (Attention, lambda: (torch.randn(4, 10, 8), _classes(4)), "att"),
    "transformer_seq2seq": (Seq2Seq, lambda: (torch.randint(0, 50, (4, 12)), _classes(4)), "t"),
    "conv2d_channels_last": (lambda: Vision().to(memory_format=torch.channels_last),
                             lambda: (torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last), _classes(4)),
                             "net"),
    "patches_and_max_norm": (Patches, lambda: (torch.randint(0, 100, (6, 5)), _classes(6)), "body"),
    "conv1d_norms_bf16_autocast": (lambda: Autocast(Signal()), lambda: (torch.randn(4, 4, 32), _classes(4)),
                                   "inner.net"),
    "embedding_bag": (Bag, lambda: (torch.randint(0, 200, (8, 6)), _classes(8)), "mlp"),
    "parametrizations": (Parametrized, lambda: (torch.randn(8, 16), _classes(8)), "b"),
}


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, -2), y)


def _state(model):
    return [p.grad for p in model.parameters()] + [b.clone() for b in model.buffers()]


def _train(model, batch, steps, plan=None, graph=None, optimizer_class=torch.optim.AdamW):
    """``steps`` optimizer steps (AdamW by default) from seed 5 (dropout draws alike); the parameters and
    buffers after them, and the executor when under ``plan``."""
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    ex = apply(model, plan, graph=graph, optimizer=optimizer) if plan is not None else None
    torch.manual_seed(5)
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            _loss(model, batch).backward()
            optimizer.step()
    finally:
        if ex is not None:
            ex.remove()
    return [t.detach().clone() for t in model.state_dict().values()], ex


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_fake_trace_is_the_real_step_and_a_plan_inside_each_layer_trains_bitwise(case, quick_timer, same_structure):
    build, data, module = CASES[case]
    torch.manual_seed(0)
    model, batch = build(), data()
    fake = profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer, name=case)
    real = profile(copy.deepcopy(model), batch, _loss, device="cpu", progress=False, measure=False, repeats=1,
                   name=case)
    same_structure(real, fake)

    plan = solve(fake, None, "manual", checkpoint=[module]).plan  # every activation made inside ``module``
    want, _ = _train(copy.deepcopy(model), batch, 2)
    got, ex = _train(copy.deepcopy(model), batch, 2, plan, fake)
    assert ex.last_step.replays == simulate(fake, plan).recomputed_ops > 0
    assert all(map(torch.equal, got, want))
    if case.startswith("lstm"):  # the replays ran oneDNN's LSTM layer, and its backward read their workspaces
        replayed = {p for e in schedule(fake, plan).of("recompute") for p in e.ops}
        assert any(fake.ops[p].name == "aten.mkldnn_rnn_layer.default" for p in replayed)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lstm", "gru", "conv1d_norms_bf16_autocast", "patches_and_max_norm"])
def test_the_cpu_kernel_rules_under_the_cuda_emulation(case, tmp_path, same_structure):
    """The cases whose fake trace follows the CPU's kernels (fake.py ``KERNEL_SHAPES``,
    ``MIXED_DTYPE_OUTPUTS``, ``STORAGE_OF_INPUT``; optime's real argument values) under CUDA's rules on the
    CPU (the allocator's rounding, the emulated device's fake trace), where the kernels are still the CPU's:
    oneDNN's workspace made at the kernel's size and replayed, mixed-precision statistics, col2im's storage,
    bitwise. (The timer is made under the
    emulation: a timer takes its device layer, and the allocator's rounding, when it is made.)"""
    from memplan.planner.probe.device import emulate_cuda

    build, data, module = CASES[case]
    with emulate_cuda():
        torch.manual_seed(0)
        model, batch = build(), data()
        timer = OpTimer(torch.device("cuda"), cache_dir=tmp_path, min_runs=1, target_s=0.0)
        fake = profile(model, batch, _loss, device="cuda", progress=False, fake=True, timer=timer, name=case)
        real = profile(copy.deepcopy(model), batch, _loss, device="cuda", progress=False, measure=False,
                       repeats=1, name=case)
        same_structure(real, fake)
        plan = solve(fake, None, "manual", checkpoint=[module]).plan
        want, _ = _train(copy.deepcopy(model), batch, 2)
        got, ex = _train(copy.deepcopy(model), batch, 2, plan, fake)
    assert ex.last_step.replays == simulate(fake, plan).recomputed_ops > 0
    assert all(map(torch.equal, got, want))


def test_lstm_backward_timed_alone_runs_on_its_forwards_workspace(tmp_path):
    """The isolated timing of ``mkldnn_rnn_layer_backward`` on materialised arguments. Given a workspace of
    the meta function's size (none: how the fake trace recorded it before ``KERNEL_SHAPES``), oneDNN read
    past it and segfaulted (the process dies: a child runs it); the workspace is now rebuilt by the forward
    where it has the forward's size (timed alone), and the call is timed analytically where it has not."""
    code = "\n".join([
        "import dataclasses, torch",
        "from torch.utils._python_dispatch import TorchDispatchMode",
        "from memplan.planner.probe.optime import OpTimer, record_call",
        "calls = []",
        "class Record(TorchDispatchMode):",
        "    def __torch_dispatch__(self, func, types, args, kwargs=None):",
        "        out = func(*args, **(kwargs or {}))",
        "        if func is torch.ops.aten.mkldnn_rnn_layer_backward.default:",
        "            calls.append(record_call(func, args, kwargs or {}, out))",
        "        return out",
        "lstm, x = torch.nn.LSTM(16, 24, num_layers=2), torch.randn(12, 4, 16)",
        "with Record():",
        "    lstm(x)[0].sum().backward()",
        "assert len(calls) == 2, calls",
        "empty = dataclasses.replace(calls[0].args[22], shape=(0,), stride=(1,), storage_bytes=0)",
        "calls.append(dataclasses.replace(calls[0], args=(*calls[0].args[:22], empty)))",
        f"timer = OpTimer(torch.device('cpu'), cache_dir={str(tmp_path)!r}, min_runs=1, target_s=0.0)",
        "timings = timer.time(calls)",
        "assert [t.source for t in timings] == ['isolated', 'isolated', 'analytic'], timings",
        "assert all(t.time_s > 0 for t in timings), timings",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"


def test_a_profile_leaves_the_model_its_gradients_the_optimizer_and_the_random_streams_as_they_were(tmp_path):
    """A real profile trains several steps (here AdamW at lr 1e-2, batch norm and dropout): afterwards the
    model is bit for bit the one given, as are its gradients, the optimizer's state and the random streams;
    a fake one leaves the random streams too; ``restore=False`` leaves the model trained."""
    torch.manual_seed(0)
    model, batch = Recurrent("GRU"), (torch.randn(4, 12, 16), _classes(4))
    model.head.register_buffer("seen", torch.zeros(()))  # a buffer the forward writes

    def count(module, args, out):
        module.seen.add_(1)

    model.head.register_forward_hook(count)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    optimizer.step()  # a state to keep, and gradients left from the step
    before = copy.deepcopy((model.state_dict(), _state(model), optimizer.state_dict()))
    rng = torch.get_rng_state()

    profile(model, batch, _loss, optimizer=optimizer, device="cpu", progress=False, repeats=2)
    after = (model.state_dict(), _state(model), optimizer.state_dict())
    assert all(map(torch.equal, before[0].values(), after[0].values()))
    assert all(map(torch.equal, before[1], after[1]))
    for p, s in before[2]["state"].items():
        assert s.keys() == after[2]["state"][p].keys()
        assert all(torch.equal(v, after[2]["state"][p][k]) for k, v in s.items())
    assert torch.equal(torch.get_rng_state(), rng)

    fake = profile(model, batch, _loss, optimizer=optimizer, device="cpu", progress=False, fake=True,
                   timer=OpTimer(torch.device("cpu"), cache_dir=tmp_path, min_runs=1, target_s=0.0))
    assert fake.ops and torch.equal(torch.get_rng_state(), rng)  # its timings drew random arguments
    assert all(map(torch.equal, before[0].values(), model.state_dict().values()))

    profile(model, batch, _loss, optimizer=optimizer, device="cpu", progress=False, repeats=1, restore=False)
    assert not torch.equal(model.head.weight, before[0]["head.weight"])
    assert model.head.seen.item() > before[0]["head.seen"].item()


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def test_sparse_gradients_profile_for_real_and_are_refused_in_one_line_under_fake(quick_timer):
    """``nn.Embedding(sparse=True)`` makes a sparse gradient in backward: fake tensors do not trace it (the
    tracer read its storage and failed with NotImplementedError). The fake profile says so in one line; the
    real profile plans it, and the plan trains bitwise (SGD takes sparse gradients)."""
    from memplan.planner.probe.fake import FakeTraceError

    torch.manual_seed(0)
    model, batch = SparseBag(), (torch.randint(0, 100, (8, 6)), _classes(8))
    with pytest.raises(FakeTraceError, match=r"in the backward \(EmbeddingBackward0\) makes a sparse_coo tensor "
                                             r".*profile without --fake") as e:
        profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert "\n" not in str(e.value)
    real = profile(model, batch, _loss, device="cpu", progress=False, measure=False, repeats=1,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    plan = solve(real, None, "manual", checkpoint=["head"]).plan
    want, _ = _train(copy.deepcopy(model), batch, 2, optimizer_class=torch.optim.SGD)
    got, _ = _train(copy.deepcopy(model), batch, 2, plan, real, optimizer_class=torch.optim.SGD)
    assert all(map(torch.equal, got, want))


@pytest.mark.parametrize("how", ["torch.compile(model)", "model[0].compile()"])
def test_a_compiled_model_is_refused_in_one_line_by_profile_and_apply(how):
    """memplan traces and runs eager steps; a compiled module failed inside torch with an internal assert."""
    from memplan.planner.core.errors import WorkloadError

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    graph = profile(model, torch.randn(4, 8), lambda m, b: m(b).sum(), device="cpu", progress=False,
                    measure=False, repeats=1)
    plan = solve(graph, None, "manual", checkpoint=["0"]).plan
    if how == "torch.compile(model)":
        compiled, match = torch.compile(model), r"the model is compiled with torch\.compile.*model\._orig_mod"
    else:
        model[0].compile()
        compiled, match = model, r"module '0' is compiled with torch\.compile.*without \.compile\(\)"
    for call in (lambda: profile(compiled, torch.randn(4, 8), lambda m, b: m(b).sum(), device="cpu",
                                 progress=False, fake=True),
                 lambda: apply(compiled, plan, graph=graph)):
        with pytest.raises(WorkloadError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_a_real_profile_of_a_meta_model_is_refused_in_one_line():
    """A real profile trains the model; on the meta device it has no data (torch's NotImplementedError
    from ``model.to`` reached the CLI as an internal error). The fake profile is the way."""
    from memplan.planner.core.errors import WorkloadError

    with torch.device("meta"):
        model = Parametrized()
    with pytest.raises(WorkloadError, match=r"the model is on the meta device \(a\.bias has no data\).*fake=True"):
        profile(model, (torch.randn(8, 16), _classes(8)), _loss, device="cpu", progress=False)


def _gradient_penalty(model, batch):
    """WGAN-GP's loss: the gradient of the output with respect to the input, in the graph (create_graph)."""
    x, y = batch
    x = x.clone().requires_grad_(True)
    out = model(x)
    gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.cross_entropy(out, y) + 0.1 * gx.pow(2).mean()


@pytest.mark.parametrize("fake", [False, True])
def test_a_loss_that_runs_autograd_in_its_forward_is_refused_in_one_line(fake):
    """A gradient penalty runs backward nodes before the loss is returned. The real profile crashed in its
    lifetime pass (autograd read a saved tensor that pass's hooks do not keep: "Output of saved tensor
    unpack_hook expected to be a Tensor", reported as the user's loss_fn failing); now both profiles name
    what the step does. (A plan made for the loss without the penalty still trains the penalised loop
    bitwise: the executor lets autograd's ops through.)"""
    from memplan.planner.core.errors import WorkloadError

    torch.manual_seed(0)
    model, batch = Parametrized(), (torch.randn(8, 16), _classes(8))
    with pytest.raises(WorkloadError, match=r"^loss_fn runs autograd inside the step's forward \(in loss: "
                                            r"torch\.autograd\.grad.*train this loss without a plan") as e:
        profile(model, batch, _gradient_penalty, device="cpu", progress=False, fake=fake, measure=False,
                repeats=1)
    assert "\n" not in str(e.value)
    if fake:
        return
    graph = profile(model, batch, _loss, device="cpu", progress=False, measure=False, repeats=1)
    plan = solve(graph, None, "manual", checkpoint=["b"]).plan
    runs = []
    for p in (None, plan):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        ex = apply(m, p, graph=graph, optimizer=opt) if p is not None else None
        torch.manual_seed(5)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            _gradient_penalty(m, batch).backward()
            opt.step()
        if ex is not None:
            assert ex.last_step.replays > 0
            ex.remove()
        runs.append([t.detach().clone() for t in m.state_dict().values()])
    assert all(map(torch.equal, *runs))


class Checkpointed(nn.Module):
    """Four residual MLP blocks, each under the model's own ``torch.utils.checkpoint`` (what
    ``gradient_checkpointing_enable()`` does in transformers), then a head left to the plan."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(),
                                                  nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 5))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant, preserve_rng_state=False)
        return self.head(h).mean(1)


def _least_peak_plan(graph):
    """A plan at the least peak memplan finds without offload (the solver's quote when the lower bound
    cannot be met)."""
    from memplan.planner.core.errors import Infeasible

    try:
        return solve(graph, memory_lower_bound(graph), "auto", time_limit_s=5).plan
    except Infeasible as e:
        return solve(graph, e.min_feasible_bytes, "auto", time_limit_s=5).plan


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_that_checkpoints_itself_is_profiled_as_it_runs(reentrant, quick_timer, same_structure):
    """The graph walk read every saved tensor, and a tensor that non-reentrant checkpointing packed was
    unpacked there: checkpoint recomputed the block during the walk, and the recomputed activations became
    the nodes' saved tensors (this model predicted 17.3 MB for a step measured at 6.8 MB; GPT-2 with
    ``gradient_checkpointing_enable()`` 14.3 MB for 6.2 MB). Now packed tensors are read packed: measured =
    predicted, with and without a plan, and the fake trace is the real step. (With ``preserve_rng_state``,
    checkpoint's copy of the CPU's random state, 5,056 B per call and made by no op, is not in the graph:
    a CPU-only shortfall.)"""
    from memplan.executor.session import run_plan

    torch.manual_seed(0)
    model, batch = Checkpointed(reentrant), (torch.randn(32, 32, 16), _classes(32))
    graph = profile(model, batch, _loss, device="cpu", progress=False, measure=False, repeats=1)
    fake = profile(model, batch, _loss, device="cpu", progress=False, fake=True, timer=quick_timer)
    same_structure(graph, fake)
    keep = simulate(graph, None).peak_bytes
    # keep everything; the head checkpointed; and the least peak without offload (it recomputes the blocks'
    # inputs, which checkpoint's frame holds from the block's last op's backward to its first op's)
    for plan in (solve(graph, keep, "dp").plan, solve(graph, None, "manual", checkpoint=["head"]).plan,
                 _least_peak_plan(graph)):
        opt = torch.optim.AdamW(model.parameters())
        report = run_plan(model, batch, _loss, opt, plan, graph, steps=2)
        assert abs(report.measured_peak_bytes - report.predicted_peak_bytes) <= 512, report
    assert keep < 8 * 2**20  # the blocks' activations are not saved (17.3 MB before the fix)
    want, _ = _train(copy.deepcopy(model), batch, 2)
    got, _ = _train(copy.deepcopy(model), batch, 2, solve(graph, None, "manual", checkpoint=["head"]).plan, graph)
    assert all(map(torch.equal, got, want))


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32), nn.LayerNorm(32))
        self.temperature = nn.Parameter(torch.tensor(0.07))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


def _contrastive(model, batch):
    """The model called twice in one step (two views), as contrastive and siamese losses do."""
    a, b = model(batch[0]), model(batch[1])
    return F.cross_entropy(a @ b.t() / model.temperature, torch.arange(a.shape[0]))


@pytest.mark.parametrize("fuse", [None, "backward", "forward"])
def test_a_loss_that_calls_the_model_twice_trains_under_a_plan_bitwise(fuse):
    """The executor began a new step at every call of the model: the second call's ops were matched against
    the first's and the step was refused ("forward op 16 differs: the plan expects aten.addmm, the model ran
    aten.mm"). A call within a step's forward, up to as many as the profiled step made, is now that step's.
    An evaluation forward between the steps stays outside them."""
    torch.manual_seed(0)
    model, batch = Siamese(), (torch.randn(32, 16), torch.randn(32, 16))
    graph = profile(copy.deepcopy(model), batch, _contrastive, device="cpu", progress=False, measure=False,
                    repeats=1)
    assert sum(c.path == "" for c in graph.module_calls) == 2
    plan = solve(graph, None, "manual", checkpoint=["net"]).plan  # recompute inside both calls
    runs = []
    for p in (None, plan):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        ex = apply(m, p, graph=graph, optimizer=opt, fuse=fuse) if p is not None else None
        torch.manual_seed(5)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            _contrastive(m, batch).backward()
            opt.step()
            m.eval()
            with torch.no_grad():
                m(batch[0])
            m.train()
        if ex is not None:
            assert ex.last_step.replays == simulate(graph, plan).recomputed_ops > 0
            ex.remove()
        runs.append([t.detach().clone() for t in m.state_dict().values()])
    assert all(map(torch.equal, *runs))
