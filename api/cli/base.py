"""The command-line app, its two consoles, and the one place memplan's errors become a red line and an
exit code (:func:`guard`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from memplan.planner.core.errors import Infeasible, MemplanError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="memplan: plan what to keep, recompute or offload so a training step fits a memory budget.")
out = Console()
err = Console(stderr=True)

EXIT_USER = 2
EXIT_INTERNAL = 1


def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map memplan's errors to one red line and an exit code: the one place this is decided."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Infeasible as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except MemplanError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_USER) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback for users
            if os.environ.get("MEMPLAN_DEBUG"):
                raise
            err.print(f"[red]internal error:[/red] {type(e).__name__}: {e} (set MEMPLAN_DEBUG=1 for the traceback)",
                      highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")


def working(what: str, *, quiet: bool) -> contextlib.AbstractContextManager[Any]:
    """A spinner on stderr while a long call runs (none under --json or off a terminal)."""
    return contextlib.nullcontext() if quiet or not err.is_terminal else err.status(what, spinner="dots")
