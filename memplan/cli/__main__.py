"""`python -m memplan.cli`: the `memplan` command."""

from memplan.cli import main

main()
