"""`python -m areno.train [CONFIG] [key=value ...] [--algorithm NAME]`: the same as `areno train`."""

import sys

from areno.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
