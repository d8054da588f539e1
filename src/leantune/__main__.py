"""`python -m leantune` runs the same CLI as the `leantune` console script."""

import sys

from .cli import main

sys.exit(main())
