"""The test suite as a package, so that ``tests.helpers`` imports the same way in pytest and in the
worker processes tests start (pytest runs with the repo root on ``pythonpath``, see pyproject.toml)."""
