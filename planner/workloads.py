"""Workloads: a model, an example batch and a loss function, built-in or loaded from a file.

A workload is what one training step needs. The calling convention, shared by the profiler, the
measurement harness and the executor, is :func:`training_step`::

    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)      # the forward and the loss; returns a scalar tensor
    loss.backward()
    optimizer.step()

``loss_fn(model, batch)`` calls the model itself, so a batch can be anything (a tensor, a tuple, a dict of
keyword arguments) and labels never need to pass through the model. Ops it runs outside the model's
modules are attributed to the module ``loss``.

Built-ins (random weights, nothing downloaded; sized so one CPU step takes well under a second):

* ``mlp``    a chain of ``depth`` Linear+ReLU layers;
* ``resnet`` transformers' ``ResNetForImageClassification`` on small images;
* ``gpt2``   transformers' ``GPT2LMHeadModel``, dropout on, next-token cross-entropy;
* ``unet``   a small U-Net defined here: long skip connections make it a DAG, not a chain;
* ``bert``   transformers' ``BertForMaskedLM``, masked-token cross-entropy;
* ``rnn``    a ``GRUCell`` (``cell="gru"``) or ``LSTMCell`` (``cell="lstm"``) unrolled over ``steps``
  time steps: its gates are finished by in-place ops that read other activations.

Each takes ``size`` (a preset: ``small``, the default, or a larger one from :data:`SIZES`) and keyword
overrides named after the transformers config field they set (``load_workload("gpt2", n_layer=12)``,
``load_workload("bert", size="base")``). ``path/to/file.py:function`` calls ``function(**overrides)``,
which must return ``(model, example_batch, loss_fn)``.
"""

from __future__ import annotations

import dis
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import PositiveInt
from torch import nn

from memplan.planner.core.errors import MemplanError, WorkloadError

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class Workload:
    """One training step's ingredients; ``loss_fn(model, batch)`` returns the scalar loss."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: LossFn


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn) -> torch.Tensor:
    """``loss_fn(model, batch)``, checked: raises :class:`WorkloadError` unless it is a one-element tensor
    that requires grad (what ``loss.backward()`` needs), and when ``loss_fn`` (the user's code, or the
    model it calls) raises or calls ``sys.exit``: one line naming the loss function (where it is defined)
    and what it raised. memplan's own code runs inside the call too (the profiler's and the executor's
    dispatch modes and hooks): an exception raised there (:func:`raised_by_memplan`) is memplan's bug, not
    the user's, and propagates unchanged, as do memplan's domain errors."""
    try:
        loss = loss_fn(model, batch)
    except (MemplanError, KeyboardInterrupt):
        raise
    except SystemExit as e:
        raise WorkloadError(f"loss_fn(model, batch) called sys.exit({e.code!r}){_where(loss_fn)}") from None
    except Exception as e:
        if raised_by_memplan(e):
            raise
        raise WorkloadError(f"loss_fn(model, batch) raised {type(e).__name__}: {_one_line(e)}{_where(loss_fn)}") from e
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        got = (f"a tensor of shape {list(loss.shape)}{'' if loss.requires_grad else ' that does not require grad'}"
               if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
        raise WorkloadError(f"loss_fn(model, batch) must return a scalar tensor that requires grad, got {got}")
    return loss


STEP_PHASES = ("forward", "backward", "optimizer")
T = typing.TypeVar("T")
PhaseRunner = Callable[[str, Callable[[], T]], T]


def refuse_compiled(model: nn.Module) -> None:
    """:class:`WorkloadError` when ``model`` or a module in it is compiled (``torch.compile(module)``, or
    ``module.compile()``): memplan traces and runs eager steps op by op, and a compiled module runs its own
    graphs (the profile fails inside torch, and a plan could not reach the compiled code's activations)."""
    for name, m in model.named_modules():
        wrapped = type(m).__name__ == "OptimizedModule" and type(m).__module__.startswith("torch._dynamo")
        if wrapped or getattr(m, "_compiled_call_impl", None) is not None:
            what = f"module {name!r}" if name else "the model"
            how = (f"pass the module it wraps ({name or 'model'}._orig_mod) instead" if wrapped
                   else "build it without .compile()")
            raise WorkloadError(f"{what} is compiled with torch.compile: memplan profiles and runs eager training "
                                f"steps; {how}, and train that, uncompiled, under the plan")


def _run(_phase: str, fn: Callable[[], T]) -> T:
    return fn()


def training_step(model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
                  run_phase: PhaseRunner | None = None) -> torch.Tensor:
    """One real training step, the one memplan models (see the module docstring); returns the loss,
    detached. Every caller that trains a step (the profiler's tracer, the measurement, the executor's
    runs, the distributed harness) runs this one.

    ``run_phase(phase, fn)`` runs each phase of the step and returns ``fn()``'s result: ``"forward"`` (the
    model and the loss; ``fn`` returns the loss), ``"backward"`` and ``"optimizer"``, in that order, after
    ``zero_grad``. It is where a caller times a phase (:class:`memplan.planner.probe.measure.PhaseClock`),
    traces it or reads the loss before backward; None runs them as they are."""
    run = run_phase or _run
    optimizer.zero_grad(set_to_none=True)
    loss = run("forward", lambda: compute_loss(model, batch, loss_fn))
    run("backward", lambda: loss.backward())
    run("optimizer", lambda: optimizer.step())
    return loss.detach()


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (foreach) over the parameters that require grad: what the profiler uses when given none."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)


# ---- built-in models -------------------------------------------------------------------------------
# Options carry the names of the transformers config they set (n_layer, hidden_size, ...); ``size`` picks a
# preset (SIZES below) that explicit options override. Counts and sizes are ``PositiveInt``: a workload built
# with none of a layer or a width of 0 has nothing to train, and ``--set depth=-1`` is refused naming the option.


def _mlp(*, depth: PositiveInt, width: PositiveInt, batch_size: PositiveInt, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(batch_size, width)
    y = torch.randn(batch_size, width)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(model(inputs), target)

    return Workload("mlp", model, (x, y), loss_fn)


def _classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(pixel_values=batch["pixel_values"]).logits
    return nn.functional.cross_entropy(logits, batch["labels"])


def _resnet(*, layer_type: str, embedding_size: PositiveInt, hidden_sizes: tuple[PositiveInt, ...],
            depths: tuple[PositiveInt, ...], image_size: PositiveInt, batch_size: PositiveInt,
            num_labels: PositiveInt = 10, seed: int = 0) -> Workload:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(embedding_size=embedding_size, hidden_sizes=list(hidden_sizes), depths=list(depths),
                          layer_type=layer_type, num_labels=num_labels)
    model = ResNetForImageClassification(config)
    batch = {"pixel_values": torch.randn(batch_size, 3, image_size, image_size),
             "labels": torch.randint(0, num_labels, (batch_size,))}
    return Workload("resnet", model, batch, _classification_loss)


def _token_batch(vocab_size: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _gpt2(*, n_layer: PositiveInt, n_embd: PositiveInt, n_head: PositiveInt, vocab_size: PositiveInt,
          seq_len: PositiveInt, batch_size: PositiveInt,
          dropout: float = 0.1, attn_implementation: str = "eager", seed: int = 0) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq_len,
                        vocab_size=vocab_size, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, use_cache=False)
    config._attn_implementation = attn_implementation
    model = GPT2LMHeadModel(config)
    batch = _token_batch(vocab_size, batch_size, seq_len)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # next-token prediction: position t predicts token t+1
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           batch["input_ids"][:, 1:].reshape(-1))

    return Workload("gpt2", model, batch, loss_fn)


def _bert(*, num_hidden_layers: PositiveInt, hidden_size: PositiveInt, num_attention_heads: PositiveInt,
          vocab_size: PositiveInt, seq_len: PositiveInt, batch_size: PositiveInt, dropout: float = 0.1, attn_implementation: str = "eager",
          seed: int = 0) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads, intermediate_size=4 * hidden_size,
                        max_position_embeddings=seq_len, vocab_size=vocab_size, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    config._attn_implementation = attn_implementation
    model = BertForMaskedLM(config)
    batch = _token_batch(vocab_size, batch_size, seq_len)
    # 15% of positions are predicted; the others are ignored by the loss (label -100)
    masked = torch.rand(batch_size, seq_len) < 0.15
    batch["labels"] = torch.where(masked, batch["input_ids"], torch.full_like(batch["input_ids"], -100))

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))

    return Workload("bert", model, batch, loss_fn)


class _ConvBlock(nn.Sequential):
    def __init__(self, c_in: int, c_out: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    """A small U-Net (Ronneberger et al., 2015): each encoder level's output is concatenated into the
    decoder level of the same resolution, so activations cross the whole network (a DAG)."""

    def __init__(self, channels: tuple[int, ...] = (16, 32, 64, 128), in_channels: int = 3,
                 out_channels: int = 3):
        super().__init__()
        self.down = nn.ModuleList()
        c = in_channels
        for width in channels[:-1]:
            self.down.append(_ConvBlock(c, width))
            c = width
        self.pool = nn.MaxPool2d(2)
        self.bottom = _ConvBlock(c, channels[-1])
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        c = channels[-1]
        for width in reversed(channels[:-1]):
            self.up.append(nn.ConvTranspose2d(c, width, 2, stride=2))
            self.merge.append(_ConvBlock(2 * width, width))
            c = width
        self.head = nn.Conv2d(c, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def _unet(*, channels: tuple[PositiveInt, ...], image_size: PositiveInt, batch_size: PositiveInt, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = UNet(tuple(channels))
    x = torch.randn(batch_size, 3, image_size, image_size)
    target = torch.randn(batch_size, 3, image_size, image_size)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(model(inputs), target)

    return Workload("unet", model, (x, target), loss_fn)


class UnrolledCell(nn.Module):
    """A recurrent cell (``nn.GRUCell`` or ``nn.LSTMCell``) unrolled over a sequence, then a linear head
    on the last hidden state. On CPU the cells compute their gates with ``addmm`` and finish them in place
    (``add_``, ``sigmoid_``, ``tanh_``, ``mul_`` on chunks, reading other activations): the in-place chains
    the profiler marks rebuildable."""

    def __init__(self, cell: str, input_size: int, hidden_size: int):
        super().__init__()
        if cell not in ("gru", "lstm"):
            raise WorkloadError(f"workload 'rnn': cell must be 'gru' or 'lstm', got {cell!r}")
        self.lstm = cell == "lstm"
        self.cell = (nn.LSTMCell if self.lstm else nn.GRUCell)(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (steps, batch, input_size)
        h = x.new_zeros(x.shape[1], self.cell.hidden_size)
        c = h
        for x_t in x:
            if self.lstm:
                h, c = self.cell(x_t, (h, c))
            else:
                h = self.cell(x_t, h)
        return self.head(h)


def _rnn(*, cell: str, steps: PositiveInt, input_size: PositiveInt, hidden_size: PositiveInt,
         batch_size: PositiveInt, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = UnrolledCell(cell, input_size, hidden_size)
    x = torch.randn(steps, batch_size, input_size)
    y = torch.randn(batch_size, input_size)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.mse_loss(model(inputs), target)

    return Workload("rnn", model, (x, y), loss_fn)


BUILTINS: dict[str, Callable[..., Workload]] = {
    "mlp": _mlp, "resnet": _resnet, "gpt2": _gpt2, "unet": _unet, "bert": _bert, "rnn": _rnn,
}

# ``size`` presets; "small" is the default, sized for a CPU step well under a second. The larger ones are
# the usual architectures (GPT-2 and BERT base, ResNet-18/50) at a batch a 2-core CPU still steps in seconds.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "small": {"depth": 16, "width": 256, "batch_size": 1024},
        "large": {"depth": 32, "width": 1024, "batch_size": 2048},
    },
    "resnet": {
        "small": {"layer_type": "basic", "embedding_size": 32, "hidden_sizes": (32, 64, 128, 256),
                  "depths": (2, 2, 2, 2), "image_size": 64, "batch_size": 32},
        "18": {"layer_type": "basic", "embedding_size": 64, "hidden_sizes": (64, 128, 256, 512),
               "depths": (2, 2, 2, 2), "image_size": 128, "batch_size": 8},
        "50": {"layer_type": "bottleneck", "embedding_size": 64, "hidden_sizes": (256, 512, 1024, 2048),
               "depths": (3, 4, 6, 3), "image_size": 128, "batch_size": 8},
    },
    "gpt2": {
        "small": {"n_layer": 6, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "seq_len": 128, "batch_size": 4},
        "base": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq_len": 256, "batch_size": 4},
    },
    "bert": {
        "small": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 8192,
                  "seq_len": 128, "batch_size": 4},
        "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 30522,
                 "seq_len": 256, "batch_size": 4},
    },
    "rnn": {
        "small": {"cell": "gru", "steps": 64, "input_size": 32, "hidden_size": 256, "batch_size": 64},
    },
    "unet": {
        "small": {"channels": (16, 32, 64, 128), "image_size": 64, "batch_size": 4},
        "large": {"channels": (32, 64, 128, 256, 512), "image_size": 128, "batch_size": 4},
    },
}


# ---- loading -----------------------------------------------------------------------------------------


def load_workload(spec: str, **overrides: Any) -> Workload:
    """A :class:`Workload` from a built-in name (``mlp``, ``resnet``, ``gpt2``, ``unet``, ``bert``, ``rnn``) or
    ``path/to/file.py:function``. ``overrides`` go to the builder as keyword arguments.

    Raises :class:`WorkloadError` with a one-line message for an unknown name, a missing file or
    function, an unknown override, or a function that does not return ``(model, example_batch, loss_fn)``.
    """
    w = _from_file(spec, overrides) if ":" in spec and spec.split(":", 1)[0].endswith(".py") \
        else _builtin(spec, overrides)
    if not any(p.requires_grad for p in w.model.parameters()):
        raise WorkloadError(f"workload {spec!r}{_given(overrides)} has no parameter that requires grad: "
                            f"nothing to train")
    return w


def _given(overrides: dict[str, Any]) -> str:
    """`` with depth=-1, width=8`` for the options given, to name them in an error; '' for none."""
    return f" with {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else ""


def _builtin(spec: str, overrides: dict[str, Any]) -> Workload:
    builder = BUILTINS.get(spec)
    if builder is None:
        raise WorkloadError(f"unknown workload {spec!r}: expected one of {', '.join(BUILTINS)} "
                            f"or path/to/file.py:function")
    overrides = dict(overrides)
    size = str(overrides.pop("size", "small"))
    presets = SIZES[spec]
    if size not in presets:
        raise WorkloadError(f"workload {spec!r} has no size {size!r}; sizes: {', '.join(presets)}")
    overrides = _check_overrides(spec, builder, overrides)
    return _call_user(f"workload {spec!r}{_given(overrides)}", builder, {**presets[size], **overrides})


def _check_overrides(spec: str, builder: Callable[..., Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` checked against ``builder``'s signature: each name must be a parameter, and each
    value must fit its annotation (``--set hidden_sizes=8`` for a tuple, ``--set depth=abc`` for an int
    are refused naming the option). Returns the values as the annotations read them (``8.0`` -> ``8``)."""
    from pydantic import TypeAdapter, ValidationError

    params = inspect.signature(builder).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(overrides) - set(params))
        if unknown:
            takes = [*params, "size"] if spec in BUILTINS else list(params)
            raise WorkloadError(f"workload {spec!r} has no option {', '.join(unknown)}; "
                                f"it takes {', '.join(takes) or 'none'}")
    try:
        hints = typing.get_type_hints(builder, include_extras=True)  # with PositiveInt's bound
    except Exception:  # noqa: BLE001 - a user's annotation that does not resolve: take the values as given
        return overrides
    checked = dict(overrides)
    for name, value in overrides.items():
        hint = hints.get(name)
        if hint is None:
            continue
        try:
            checked[name] = TypeAdapter(hint).validate_python(value)
        except ValidationError as e:
            base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
            wanted = getattr(base, "__name__", None) if not typing.get_args(base) else None
            wanted = wanted or _type_name(base)
            example = f" (a list: --set {name}=8,16)" if typing.get_origin(hint) in (tuple, list) else ""
            raise WorkloadError(f"workload {spec!r}: option {name}={value!r} does not fit {wanted}{example}: "
                                f"{e.errors()[0]['msg']}") from None
        except Exception:  # noqa: BLE001 - an annotation pydantic cannot check: take the value as given
            continue
    return checked


def _type_name(hint: Any) -> str:
    """``tuple[int, ...]`` for ``tuple[PositiveInt, ...]``: the annotation as a user reads it."""
    if typing.get_origin(hint) is typing.Annotated:
        return _type_name(typing.get_args(hint)[0])
    args = typing.get_args(hint)
    if not args:
        return getattr(hint, "__name__", str(hint).replace("typing.", ""))
    names = ["..." if a is Ellipsis else _type_name(a) for a in args]
    return f"{getattr(typing.get_origin(hint), '__name__', 'typing')}[{', '.join(names)}]"


# memplan's code: its subpackages (the package's folder also holds tests/ and benchmarks/)
_MEMPLAN_ROOTS = tuple(Path(__file__).resolve().parent.parent / p for p in ("planner", "solvers", "executor", "api"))
_TORCH_ROOTS = (Path(torch.__file__).resolve().parent,)


def raised_by_memplan(e: BaseException) -> bool:
    """Whether ``e`` was raised by a statement of memplan's own code (a bug of memplan's) rather than by
    the user's code or by an op the user's model ran.

    The innermost frame of ``e``'s traceback outside torch's own Python code decides: memplan's, and
    failing at a statement that is not a call (a subscript, an attribute, an ``assert``, a ``raise``...).
    A call that failed there called out of memplan, without a frame of its own in the traceback (an ATen op
    a dispatch mode runs for the model, with the model's tensors) or through torch's frames: the op's
    error is about the user's model."""
    tb = e.__traceback__
    innermost = None
    while tb is not None:
        if not _within(tb.tb_frame.f_code.co_filename, _TORCH_ROOTS):
            innermost = tb
        tb = tb.tb_next
    if innermost is None or not _within(innermost.tb_frame.f_code.co_filename, _MEMPLAN_ROOTS):
        return False
    if innermost.tb_next is not None:  # it called into torch, which raised
        return False
    at = next((i for i in dis.get_instructions(innermost.tb_frame.f_code) if i.offset == innermost.tb_lasti), None)
    return at is None or not at.opname.startswith(("CALL", "PRECALL"))


def _within(filename: str, roots: tuple[Path, ...]) -> bool:
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):  # "<string>", a name that is no path
        return False
    return any(path.is_relative_to(r) for r in roots)


def _where(loss_fn: Callable[..., Any]) -> str:
    """`` (loss_fn is NAME, FILE:LINE)``: which workload's loss function a message is about."""
    code = getattr(loss_fn, "__code__", None)
    where = f", {Path(code.co_filename).name}:{code.co_firstlineno}" if code is not None else ""
    return f" (loss_fn is {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}{where})"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _call_user(what: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)``: a workload's builder or function. What it raises (or a ``sys.exit``) becomes a
    :class:`WorkloadError` naming ``what``: a bad combination of options or a bug in the user's file is
    the user's to fix."""
    try:
        return fn(**kwargs)
    except (MemplanError, KeyboardInterrupt):
        raise
    except SystemExit as e:
        raise WorkloadError(f"{what} called sys.exit({e.code!r}) instead of returning") from None
    except Exception as e:
        raise WorkloadError(f"{what} raised {type(e).__name__}: {_one_line(e)}") from e


def _from_file(spec: str, overrides: dict[str, Any]) -> Workload:
    path_text, func_name = spec.rsplit(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise WorkloadError(f"workload file {path_text} not found (spec {spec!r})")
    if not func_name.isidentifier():
        raise WorkloadError(f"workload spec {spec!r}: {func_name!r} is not a function name")
    module_name = f"memplan_workload_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise WorkloadError(f"cannot import workload file {path_text}")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[module_name]
        raise WorkloadError(f"importing workload file {path_text} called sys.exit({e.code!r})") from None
    except Exception as e:  # the user's file: report what went wrong in one line
        del sys.modules[module_name]
        raise WorkloadError(f"importing workload file {path_text} failed: {type(e).__name__}: {_one_line(e)}") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise WorkloadError(f"workload file {path_text} has no function {func_name!r}")
    checked = _check_overrides(spec, func, overrides)
    result = _call_user(f"{spec}{_given(checked)}", func, checked)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise WorkloadError(f"{spec} must return (model, example_batch, loss_fn), "
                            f"got {type(result).__name__}")
    model, batch, loss_fn = result
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"{spec} returned a {type(model).__name__} as the model; expected a torch.nn.Module")
    if not callable(loss_fn):
        raise WorkloadError(f"{spec} returned a {type(loss_fn).__name__} as loss_fn; expected a callable "
                            f"loss_fn(model, batch) -> scalar tensor")
    return Workload(path.stem + ":" + func_name, model, batch, loss_fn)
