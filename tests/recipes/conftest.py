"""Fixtures of the recipe tests; the helpers live in recipes_testlib (a unique module name, so they
do not collide with other test folders' conftest modules)."""

import pytest
from recipes_testlib import model_fixture


@pytest.fixture
def model():
    return model_fixture()
