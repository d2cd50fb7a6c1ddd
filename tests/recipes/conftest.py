"""Fixtures of the recipe tests (the helpers live in tests/helpers/recipes.py)."""

import pytest

from tests.helpers.recipes import model_fixture


@pytest.fixture
def model():
    return model_fixture()
