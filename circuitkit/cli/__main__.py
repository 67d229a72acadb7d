"""``python -m circuitkit.cli``: the console script."""

from circuitkit.cli import main

main()
