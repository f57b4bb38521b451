"""The ``memplan`` command line (typer + rich). The only place, with the REST service, that prints.

Every command takes ``--json`` for machine-readable output on stdout. Errors the user can fix (a bad
file, an infeasible budget, an unknown workload) exit with status 2 and one line naming the problem;
anything else exits 1 with one line (set ``MEMPLAN_DEBUG=1`` for the traceback).

Read from :mod:`.base` (the app, the consoles, errors to exit codes), :mod:`.options` (shared options and
their parsing), :mod:`.files` and :mod:`.tables`, then one module per command group: :mod:`.graphs`
(profile, simulate, schema), :mod:`.planning` (solve, frontier, solvers, plan), :mod:`.maxbatch`,
:mod:`.run` (with :mod:`.ranks` for ``--nproc``), :mod:`.show`, :mod:`.serve`, :mod:`.remote` (submit, wait).
"""

import warnings

from memplan.planner.core.errors import MemplanWarning

# the command modules register their commands on the app when imported; the import is the registration,
# and its order is the order of ``memplan --help``
# isort: off
from memplan.api.cli import graphs, planning, maxbatch, run, show, serve, remote  # noqa: F401
# isort: on
from memplan.api.cli.base import app, err
from memplan.api.cli.options import WORKLOAD_HELP

__all__ = ["WORKLOAD_HELP", "app", "main"]


def main() -> None:
    warnings.showwarning = _one_line
    app()


_default_showwarning = warnings.showwarning


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """memplan's own warnings as one line on stderr; others as Python prints them."""
    if issubclass(category, MemplanWarning):
        err.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)
