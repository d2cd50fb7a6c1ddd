"""`python -m areno ...`: the same as the `areno` command."""

import sys

from areno.cli import main

sys.exit(main())
