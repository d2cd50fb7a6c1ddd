"""Several reward functions with weights (``reward.fn`` as a list, ``reward.weights``: TRL's ``reward_funcs``
and ``reward_weights``): the reward is their weighted sum, each function's score a named figure, a failing
function scores 0 for its part alone, in the sandbox and in-process, and every place that reads
``reward.fn`` takes a list."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from areno.api.config import ArenoConfig, ConfigError, ModelSection, RewardSection, load_config, to_yaml
from areno.api.preflight import check_reward, reward_needs_answer
from areno.engine.api import REWARD_FAILED_BATCHES, ArenoEngine, RewardsFailing
from areno.engine.scoring import eval_metrics
from areno.errors import RewardImportError
from areno.rewards.combined import WeightedRewards, part_names
from areno.rewards.loader import load_reward, release_reward, reward_pool_metrics, start_reward
from areno.types import Trajectory
from areno.workflows.common import (
    REWARD_FAILED_PARTS_KEY,
    WEIGHTED_SUM_PART,
    ascore_reward,
    reward_figure_means,
    warn_reward_errors,
)

HALF = "tests.helpers.rewards:half"  # 0.5
QUARTER = "tests.helpers.rewards:quarter_parsed"  # {"score": 0.25, "parsed": 1.0}
EXPLODING = "tests.helpers.rewards:exploding"  # raises RuntimeError("reward bug")


def config(*overrides: str):
    return load_config(None, ["model.path=unused", *overrides])


def section(*fns: str, **settings) -> RewardSection:
    return RewardSection(fn=list(fns), **settings)


def score(reward, completion: str = "a7b"):
    return asyncio.run(ascore_reward(reward, "p", completion, None, {}))


def trajectory(reward) -> Trajectory:
    scored = score(reward)
    info = scored.into({})
    return Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=scored.value, info=info)


def test_the_reward_is_the_weighted_sum_of_the_functions_scores():
    weighted = load_reward(section(HALF, QUARTER, weights=[3, -0.5], sandbox=False))
    assert isinstance(weighted, WeightedRewards)
    assert score(weighted).value == 3 * 0.5 - 0.5 * 0.25 == 1.375
    assert asyncio.run(weighted("p", "c")) == 1.375  # called directly, as an agent's client.reward_fn is
    unweighted = load_reward(section(HALF, QUARTER, sandbox=False))
    assert score(unweighted).value == 0.75  # weights null: 1.0 each
    one = load_reward(RewardSection(fn=HALF, weights=[-2], sandbox=False))
    assert score(one).value == -1.0  # a weight on a single function


def test_a_list_of_one_function_is_the_plain_string_bit_for_bit():
    for sandbox in (False, None):
        plain = load_reward(RewardSection(fn="tests.helpers.rewards:sevens", sandbox=sandbox))
        listed = load_reward(section("tests.helpers.rewards:sevens", sandbox=sandbox))
        try:
            assert type(listed) is type(plain) and not isinstance(listed, WeightedRewards)
            if sandbox is None:
                assert listed is plain  # the same shared pool
                continue
            for completion in ("7", "a7b", "", "x" * 13 + "77"):
                assert score(listed, completion) == score(plain, completion)
        finally:
            release_reward(plain)
            release_reward(listed)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [f"reward.fn=[{HALF},{QUARTER}]", "reward.weights=[1,2,3]"],
            "reward.weights: has 3 values but reward.fn names 2 function(s): give one weight per function, in "
            "reward.fn's order, or null for 1.0 each",
        ),
        ([f"reward.fn={HALF}", "reward.weights=[1,2]"], "reward.weights: has 2 values but reward.fn names 1 function"),
        ([f"reward.fn=[{HALF},{QUARTER}]", "reward.weights=[1,.nan]"], "reward.weights: must be finite numbers"),
        ([f"reward.fn=[{HALF}]", "reward.weights=[.inf]"], "reward.weights: must be finite numbers"),
        (
            [f"reward.fn=[{HALF},{QUARTER}]", "reward.weights=[1,-1e39]"],
            "reward.weights: must be finite numbers within",
        ),
        (["reward.fn=[]"], "reward.fn: names no function"),
        ([f"reward.fn=[{HALF},nodots]"], "reward.fn[1]: must be a dotted path"),
    ],
)
def test_weights_and_functions_that_do_not_match_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        config(*overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_each_functions_score_is_a_figure_its_own_figures_under_its_name():
    reward = load_reward(section(HALF, QUARTER, weights=[2, 4], sandbox=False))
    scored = score(reward)
    assert scored.figures == {"half": 0.5, "quarter_parsed": 0.25, "quarter_parsed/parsed": 1.0}  # unweighted
    assert reward_figure_means([trajectory(reward)], "rollout/reward") == {
        "rollout/reward/half_mean": 0.5,
        "rollout/reward/quarter_parsed_mean": 0.25,
        "rollout/reward/quarter_parsed/parsed_mean": 1.0,
    }
    held_out = eval_metrics([[scored.value]], [[trajectory(reward)]], 1.0)  # areno eval, the test rollout
    assert held_out["eval/accuracy"] == 2.0 and held_out["eval/reward/quarter_parsed/parsed_mean"] == 1.0


def test_functions_of_one_name_get_names_of_their_own_in_order():
    assert part_names(["a:score", "./b.py:score", "c.d:score_2", "e:Class.score", "f.g.h"]) == [
        "score",
        "score_3",
        "score_2",
        "score_4",
        "h",
    ]


def test_a_raising_function_scores_0_for_its_part_alone_in_process():
    reward = load_reward(section(HALF, EXPLODING, weights=[2, 1], sandbox=False))
    scored = score(reward)
    assert scored.value == 1.0 and scored.figures == {"half": 0.5, "exploding": 0.0}
    assert scored.error == "exploding: RuntimeError: reward bug"
    assert reward_pool_metrics(reward) == {}
    with pytest.raises(RuntimeError, match="reward bug"):  # a direct call raises, as one function's does
        asyncio.run(reward("p", "c"))


def test_a_functions_first_failure_names_it_and_says_it_lost_its_part_alone(caplog):
    """In-process, the error is the function's own (``TypeError: ...``), which names no function: the
    warning names its entry of reward.fn, as a sandboxed one's error names its path."""
    reward = load_reward(section(HALF, EXPLODING, sandbox=False))
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        score(reward)
    (record,) = caplog.records
    assert record.getMessage() == (
        f"reward function reward.fn[1] ({EXPLODING}) failed for prompt 'p', completion 'a7b', fields []: "
        "RuntimeError: reward bug; its part of the reward set to 0 (its later failures are counted: one warning "
        "per batch, rollout/reward_errors)"
    )


def test_a_batchs_warning_says_a_failed_function_lost_its_part_alone(caplog):
    reward = load_reward(section(HALF, EXPLODING, sandbox=False))
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        warn_reward_errors([trajectory(reward), trajectory(reward)], "step 1's rollout batch", several=True)
    assert caplog.records[-1].getMessage() == (
        "reward function failed on 2 of 2 completions of step 1's rollout batch (a failed function's part scored "
        "0, the others' kept); last error: exploding: RuntimeError: reward bug"
    )


def test_a_raising_function_scores_0_for_its_part_alone_in_the_sandbox():
    reward = start_reward(load_reward(section(QUARTER, EXPLODING, workers=1)))
    try:
        scored = score(reward)
        assert scored.value == 0.25 and scored.figures == {
            "quarter_parsed": 0.25,
            "quarter_parsed/parsed": 1.0,
            "exploding": 0.0,
        }
        assert scored.error.startswith(
            "exploding: RewardFailure: reward tests.helpers.rewards:exploding raised RuntimeError: reward bug"
        )
        metrics = reward_pool_metrics(reward)  # both pools' counters, summed
        assert metrics["rollout/reward_calls"] == 2.0 and metrics["rollout/reward_failures_error"] == 1.0
    finally:
        release_reward(reward)


def with_reward(reward: RewardSection) -> ArenoConfig:
    return ArenoConfig(model=ModelSection(path="unused"), reward=reward)


def test_the_sandbox_is_left_out_only_when_every_function_is_safe_in_process():
    safe = "areno.rewards.tasks:exact_match"  # marked safe in-process
    assert reward_pool_metrics(load_reward(section(safe, safe))) == {}  # no pool: both run in this process
    with pytest.raises(ConfigError, match="every function of reward.fn is cheap and safe in-process"):
        check_reward(with_reward(section(safe, safe, workers=2)))
    check_reward(with_reward(section(safe, HALF, workers=2)))  # half is user code: both sandboxed


def test_preflight_imports_every_function_and_names_the_entry_that_fails():
    with pytest.raises(RewardImportError) as info:
        check_reward(with_reward(section(HALF, "tests.helpers.rewards:nope")))
    assert str(info.value).startswith("reward.fn[1]: module 'tests.helpers.rewards' has no attribute 'nope'")
    # a row needs an answer when any function scores against one
    assert reward_needs_answer(section(HALF, "areno.rewards.tasks:exact_match"))
    assert not reward_needs_answer(section(HALF, QUARTER))


def test_several_functions_written_as_one_string_are_told_to_be_a_list():
    """``reward.fn=a:f,b:g`` (the brackets left out), or a list entry missing its comma: one line naming the
    key and the list to write, not an import error on the attribute ``f,b:g``."""
    with pytest.raises(RewardImportError) as info:
        check_reward(with_reward(RewardSection(fn=f"{HALF},{QUARTER}")))
    assert str(info.value) == (
        f"reward.fn: '{HALF},{QUARTER}' names 2 functions in one string: to score with several, write them as a "
        f"list, reward.fn=[{HALF}, {QUARTER}] (with reward.weights=[...] to weigh them)"
    )
    with pytest.raises(RewardImportError) as info:
        check_reward(with_reward(section(EXPLODING, f"{HALF} {QUARTER}")))
    assert str(info.value) == (
        f"reward.fn[1]: '{HALF} {QUARTER}' names 2 functions in one string: give each its own entry of the list, "
        f"separated by commas: {HALF}, {QUARTER}"
    )
    with pytest.raises(RewardImportError, match="has no attribute 'halff'"):  # a plain typo: the import's error
        check_reward(with_reward(RewardSection(fn="tests.helpers.rewards:halff")))


def test_a_list_override_from_the_command_line_and_config_yaml_round_trip(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text("def shaped(prompt, completion, answer=None, **row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    # as the shell passes it: `areno train reward.fn=[./rw.py:shaped,tests...:half] reward.weights=[1,0.5]`
    loaded = config(f"reward.fn=[./rw.py:shaped,{HALF}]", "reward.weights=[1,0.5]", f"run_dir={tmp_path / 'run'}")
    assert loaded.reward.fn == [f"{tmp_path / 'rw.py'}:shaped", HALF]  # a file made absolute, a module as it is
    assert loaded.reward.weights == [1.0, 0.5]
    (tmp_path / "config.yaml").write_text(to_yaml(loaded))
    again = load_config(tmp_path / "config.yaml")
    assert again.reward == loaded.reward
    # a later override replaces the list, with a plain string too
    assert config(f"reward.fn=[{HALF},{QUARTER}]", f"reward.fn={HALF}").reward.fn == HALF


def _failing(parts: list[str] | None) -> Trajectory:
    """A trajectory whose reward lost ``parts`` of a ``reward.fn`` list (None: the whole reward failed)."""
    info = {"reward_error": "RuntimeError: reward bug"}
    if parts:
        info[REWARD_FAILED_PARTS_KEY] = parts
    return Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=0.0, info=info)


def _checker(*overrides: str) -> SimpleNamespace:
    """What ``ArenoEngine._check_rewards`` reads of its engine."""
    return SimpleNamespace(config=config(*overrides), _reward_failed_batches={})


def test_a_failed_functions_name_goes_into_its_trajectorys_info():
    reward = load_reward(section(HALF, EXPLODING, sandbox=False))
    assert trajectory(reward).info[REWARD_FAILED_PARTS_KEY] == ["exploding"]
    assert REWARD_FAILED_PARTS_KEY not in trajectory(load_reward(section(HALF, QUARTER, sandbox=False))).info


def test_rows_that_each_lost_another_function_do_not_stop_the_run():
    """Every completion lost some function's part, but no function failed on all of them: the run goes on."""
    engine = _checker(f"reward.fn=[{HALF},{EXPLODING}]")
    for step in range(2 * REWARD_FAILED_BATCHES):
        ArenoEngine._check_rewards(engine, step, [_failing(["half"]), _failing(["exploding"])])
    assert engine._reward_failed_batches == {}


def test_a_function_that_fails_on_every_completion_stops_the_run_naming_its_entry():
    engine = _checker(f"reward.fn=[{HALF},{EXPLODING}]")
    batch = [_failing(["exploding"]), _failing(["half", "exploding"])]
    for step in range(REWARD_FAILED_BATCHES - 1):
        ArenoEngine._check_rewards(engine, step, batch)
    assert engine._reward_failed_batches == {"exploding": REWARD_FAILED_BATCHES - 1}
    with pytest.raises(RewardsFailing) as info:
        ArenoEngine._check_rewards(engine, REWARD_FAILED_BATCHES - 1, batch)
    assert str(info.value) == (
        f"reward.fn[1] ({EXPLODING}) failed on every completion of the last {REWARD_FAILED_BATCHES} rollout "
        f"batches (step {REWARD_FAILED_BATCHES}; last: RuntimeError: reward bug): fix that function; the run "
        "stopped rather than train on rewards missing its part"
    )


def test_a_batch_where_the_function_scores_once_starts_its_count_again():
    engine = _checker(f"reward.fn=[{HALF},{EXPLODING}]")
    always, once_fine = [_failing(["exploding"])] * 2, [_failing(["exploding"]), _failing(["half"])]
    for step, batch in enumerate([always, always, once_fine, always, always]):
        ArenoEngine._check_rewards(engine, step, batch)
    assert engine._reward_failed_batches == {"exploding": 2}


def test_a_weighted_sum_beyond_float32_on_every_completion_stops_naming_the_weights():
    engine = _checker(f"reward.fn=[{HALF},{QUARTER}]")
    with pytest.raises(RewardsFailing, match=r"^the weighted sum of reward.fn's scores was beyond float32 .*"):
        for step in range(REWARD_FAILED_BATCHES):
            ArenoEngine._check_rewards(engine, step, [_failing([WEIGHTED_SUM_PART])])


def test_a_single_function_failing_everywhere_stops_as_before():
    engine = _checker(f"reward.fn={EXPLODING}")
    with pytest.raises(RewardsFailing, match=r"^every reward call of the last 3 rollout batches failed \(step 3;"):
        for step in range(REWARD_FAILED_BATCHES):
            ArenoEngine._check_rewards(engine, step, [_failing(None), _failing(None)])
