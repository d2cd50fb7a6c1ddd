"""A misspelt recipe option is named with the closest valid one, as config keys and recipe names are."""

from __future__ import annotations

import pytest

from areno.errors import ConfigError
from areno.recipes import get_recipe


def test_a_misspelt_algorithm_kwarg_suggests_the_option():
    with pytest.raises(ConfigError, match=r"unknown option 'gama' \(did you mean 'gamma'\?\); valid options: "):
        get_recipe("ppo", policy_kwargs={"gama": 0.9})
    with pytest.raises(ConfigError) as info:  # nothing close: no guess
        get_recipe("ppo", policy_kwargs={"zzzz": 1})
    assert "did you mean" not in str(info.value)


def test_a_misspelt_factory_option_suggests_the_option():
    with pytest.raises(ConfigError, match=r"has no option\(s\) \['teacher_pth'\] \(did you mean 'teacher_path'\?\)"):
        get_recipe("opd", teacher_pth="/t")
