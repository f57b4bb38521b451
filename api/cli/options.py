"""The options several commands share (typer annotations) and the parsing of what they give: workload
options (``--set``), budgets, ``--nproc`` with ``--fake``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.graph import Graph
from memplan.planner.core.units import check_budget

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE", help="a workload option, repeatable: --set n_layer=2 --set size=base "
                                       "(built-ins take their config's field names; see planner/workloads.py)")]

FuseOpt = Annotated[str | None, typer.Option(
    "--fuse", help="backward or forward: the training loop steps the optimizer inside backward (each module's "
                   "gradients freed there) or in the next forward")]


def fuse_mode(text: str | None, *, none: bool = False) -> str | None:
    """``--fuse``'s value: None, "backward" or "forward" (and, with ``none``, "none" for None); anything else
    is refused in one line."""
    if text is None or (none and text == "none"):
        return None
    if text not in ("backward", "forward"):
        raise MemplanError(f"--fuse {text!r}: choose backward or forward" + (" (or none)" if none else ""))
    return text


# the built-ins of memplan.planner.workloads.BUILTINS (named here: importing it would import torch for --help)
WORKLOAD_HELP = "built-in (mlp, resnet, gpt2, unet, bert, rnn) or path/to/file.py:function"


def workload_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["n_layer=2", "hidden_sizes=32,64", "layer_type=basic"]`` -> keyword arguments: JSON scalars
    (ints, floats, true/false) as such, comma-separated lists as tuples (in brackets too, as Python or JSON
    writes them: ``[32, 64]``, ``(32,)``, ``[]``), anything else as a string."""

    def value(text: str) -> Any:
        try:
            v = json.loads(text)
        except ValueError:
            return text
        return v if isinstance(v, (int, float, bool, str)) else text

    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise MemplanError(f"--set {pair!r}: expected KEY=VALUE, for example --set n_layer=2")
        text = text.strip()
        bracketed = len(text) >= 2 and text[0] + text[-1] in ("[]", "()")
        if bracketed:
            text = text[1:-1].strip()
        options[key.strip()] = tuple(value(p.strip()) for p in text.split(",") if p.strip()) \
            if bracketed or "," in text else value(text)
    return options


HostBudgetOpt = Annotated[str | None, typer.Option(
    "--host-budget", help="host memory cap for what the plan puts there (offloaded activations and streamed "
                          "optimizer state, pinned in pools sized by the plan), e.g. 400GiB")]
StatesOpt = Annotated[bool | None, typer.Option(
    "--states/--no-states", help="with --offload: also stream units' optimizer state through the host "
                                 "(default: --offload moves both; --no-states: activations only; --states "
                                 "without --offload: model states only)")]
StatesOnOpt = Annotated[str, typer.Option(
    "--states-on", help="where the model-state search may move a unit's optimizer state: auto (each way), "
                        "stream (through the device for its update) or host (stepped on the host; no gradient "
                        "accumulation); implies --states")]


def state_choice(states: bool | None, states_on: str) -> bool | str | None:
    """solve()'s ``states`` from ``--states/--no-states`` and ``--states-on``."""
    if states_on not in ("auto", "stream", "host"):
        raise MemplanError(f"--states-on {states_on!r}: expected auto, stream or host")
    if states_on == "auto":
        return states
    if states is False:
        raise MemplanError(f"--states-on {states_on} with --no-states: drop one of them")
    return states_on


FakeOpt = Annotated[bool, typer.Option(
    "--fake", help="trace the step under fake tensors: no activation, gradient or optimizer state is "
                   "allocated; each op is timed alone on this device (cached) instead")]
OwnCheckpointingOpt = Annotated[str, typer.Option(
    "--own-checkpointing", metavar="off|keep",
    help="a model that checkpoints itself (transformers' activation_checkpointing_enable): off (default) "
         "switches that off so the plan covers every activation; keep plans over its checkpointed step")]
SpecOpt = Annotated[str | None, typer.Option(
    "--device-spec", metavar="NAME|FILE", help="plan for another device: time the ops analytically from its "
                                               "spec (implies --fake): a100-80gb, h100-80gb, l4, rtx-4090 or a "
                                               "JSON file")]

NprocOpt = Annotated[int, typer.Option("--nproc", max=64, help="ranks: with --fake, each rank's memory "
                                                                     "for N ranks, traced in this process under "
                                                                     "PyTorch's fake process group")]
EngineOpt = Annotated[str, typer.Option(help="with --nproc > 1: ddp (DistributedDataParallel) or fsdp (FSDP2 "
                                             "fully_shard per block)")]


def budget_bytes(text: str, graph: Graph) -> int:
    from memplan.api.jobs import resolve_budget

    value = resolve_budget(text, graph)
    assert value is not None  # a budget string always gives bytes
    return value


def budget_list(text: str) -> list[str]:
    """``--budgets 50%,6GiB``: the budgets, each checked (no graph needed); an empty list is refused."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise MemplanError(f"--budgets {text!r}: no budget in it; give e.g. --budgets 50%,70%,6GiB")
    for b in budgets:
        check_budget(b)
    return budgets


def needs_fake(command: str, nproc: int, fake: bool) -> None:
    if nproc < 1:
        raise MemplanError(f"--nproc {nproc}: need at least 1 rank")
    if nproc > 1 and not fake:
        raise MemplanError(f"memplan {command} --nproc {nproc} needs --fake (each rank traced in this process); "
                           f"memplan run --nproc {nproc} trains on {nproc} processes")
