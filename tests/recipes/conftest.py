"""Fixtures of the recipe tests (the helpers live in tests/helpers/recipes.py)."""

import pytest

from tests.helpers.recipes import model_fixture, saved_registry


@pytest.fixture
def model():
    return model_fixture()


@pytest.fixture
def registry():
    """The recipe registry as it was, after the test."""
    with saved_registry():
        yield
