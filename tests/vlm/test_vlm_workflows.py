"""Rows with images need a workflow that puts them into its prompts: one that takes no ``vision`` (the
multi-turn, agent and teacher workflows) is refused at start-up, in one line; it rendered the prompt alone."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from tests.helpers.vlm import vl_overrides


@pytest.mark.parametrize(
    "workflow",
    ["areno.workflows.multi_turn:MultiTurnWorkflow", "areno.workflows.agent:calculator_workflow"],
)
def test_a_workflow_that_takes_no_images_is_refused_on_image_rows(tmp_path, workflow):
    cfg = load_config(None, [*vl_overrides(tmp_path, 1), f"rollout.workflow={workflow}"])
    with pytest.raises(ConfigError) as info:
        Trainer.init(cfg).shutdown()
    assert str(info.value) == (
        f"rollout.workflow={workflow}: the data's rows hold images, which this workflow does not put into its "
        "prompts (it takes no vision): use areno.workflows.rlvr:RLVRWorkflow (the default), or drop the images field"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
