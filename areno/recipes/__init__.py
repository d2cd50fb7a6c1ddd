"""Recipes as data: ``TrainingConfig`` / ``ModelRole`` / ``DataSync``, the ``@recipe`` registry and
the built-in algorithm catalog (``areno recipes`` lists it). ``RecipeRunner`` lives in
``areno.recipes.runner``."""

from areno.recipes import builtin as _builtin
from areno.recipes.config import DataSync, ModelRole, TrainingConfig
from areno.recipes.registry import TRAINING_CONFIGS, describe, get_recipe, list_recipes, main, recipe

__all__ = [
    "DataSync",
    "ModelRole",
    "TRAINING_CONFIGS",
    "TrainingConfig",
    "describe",
    "get_recipe",
    "list_recipes",
    "main",
    "recipe",
]
