"""Helpers shared by the test folders (importable as ``tests.helpers.…``, also by dotted path in worker processes)."""
