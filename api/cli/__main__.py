"""``python -m memplan.api.cli``: the ``memplan`` command."""

from memplan.api.cli import main

main()
