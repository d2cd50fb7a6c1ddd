"""areno's benchmark suite: each module is one benchmark, run from the repository root as
``python -m bench.<name>`` (``bench/README.md``); current figures in ``bench/RESULTS.md``, their history
in ``bench/LOG.md``."""
