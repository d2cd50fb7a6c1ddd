"""Fixtures for rollout tests: a tiny random decoder (the helpers live in tests/helpers/rollout.py)."""

from __future__ import annotations

import pytest

from tests.helpers.rollout import make_model


@pytest.fixture(scope="session")
def tiny():
    return make_model(0)
