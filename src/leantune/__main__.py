"""`python -m leantune` runs the same program as the `leantune` console script."""

from .cli import run

run()
