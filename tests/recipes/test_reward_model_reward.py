"""``reward.model``: a reward model's score of each sequence, times ``reward.model_weight``, added to the rewards
on the training side before the advantages (TRL's reward model in ``reward_funcs``). Its score equals
transformers' sequence classifier's logit; the advantages, a critic's returns and the logged figures read the
sum; prompt-only rows train on the model alone; every setting it cannot serve is refused in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from areno.algo import group_index_B, grpo_advantages_B
from areno.api.config import load_config
from areno.api.pipeline import run_pipeline
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.api import resolve_recipe
from areno.engine.evaluation import EvalOptions, run_eval
from areno.engine.scoring import MODEL_SCORE_INFO_KEY, add_model_scores
from areno.errors import ConfigError, ModelDirError
from areno.models.hf_io import init_model_dir, load_model, tiny_config
from areno.observe.metrics import ConsoleSink
from areno.recipes.config import RewardSync
from areno.specializations import SequenceScorerSpecialization
from areno.types import TokenBatch, Trajectory
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.recipes import RM_TINY, save_reward_model
from tests.helpers.rewards import sevens_and_length


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "hf")


def _hf_scores_B(rm_dir: Path, batch: TokenBatch) -> torch.Tensor:
    """transformers' sequence-classification logit of each sequence of ``batch``, one at a time."""
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32).eval()
    bounds = batch.cu_seqlens_B1.tolist()
    with torch.no_grad():
        return torch.stack([hf(batch.input_ids_T[lo:hi][None]).logits[0, 0] for lo, hi in zip(bounds[:-1], bounds[1:])])


def _traj(prompt: list[int], completion: list[int]) -> Trajectory:
    n = len(completion)
    return Trajectory(prompt_ids=prompt, completion_ids=completion, logprobs=[0.0] * n, versions=[0] * n, reward=0.0)


def test_the_scorer_reads_transformers_logit_of_each_sequence(rm_dir):
    batch = TokenBatch.from_trajectories([_traj([5, 6, 7], [8, 9]), _traj([10, 11], [12, 13, 14, 15])])
    scorer = SequenceScorerSpecialization(head_path=str(rm_dir))
    model = scorer.wrap_model(load_model(rm_dir, dtype=torch.float32)[0])
    with torch.no_grad():
        scores_B = scorer.extract_model_output(model, batch)["scores_B"]
    torch.testing.assert_close(scores_B, _hf_scores_B(rm_dir, batch), rtol=1e-5, atol=1e-5)


def _config(tmp_path: Path, *extra: str, reward: str = "tests.helpers.rewards:sevens_and_length"):
    return load_config(None, tiny_run_overrides(tmp_path, num_eval=0, reward=reward) + list(extra))


def _scored_steps(logged: list[dict]) -> list[dict]:
    """The metrics rows that logged the reward model's score of a training batch."""
    return [m for m in logged if "train/reward_model/score_mean" in m]


def test_the_weighted_score_is_added_before_the_advantages(tmp_path, rm_dir):
    """rewards = reward.fn's + 0.5 x (transformers' logit - 2 where the completion has no EOS); grpo's advantages of
    that sum; the logged figures."""
    trainer = Trainer.init(
        _config(tmp_path, f"reward.model={rm_dir}", "reward.model_weight=0.5", "reward.missing_eos_penalty=2.0")
    )
    try:
        rollout = trainer.rollout_token_batch(0)
        batch = rollout.batch
        runner = trainer.backend.engine.training.runner
        prepared = runner.prepare(batch)["policy"]
        metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    scores_B = _hf_scores_B(rm_dir, batch)
    truncated_B = batch.truncated_B.float()  # completions cut at rollout.max_new_tokens (4): no EOS
    assert truncated_B.any()  # a random tiny model rarely stops; the mixed case: test_add_model_scores_...
    expected_B = batch.rewards_B.float() + 0.5 * (scores_B - 2.0 * truncated_B)
    assert bool(scores_B.std() > 0.1)  # the model's part is visible beside the function's
    torch.testing.assert_close(prepared.rewards_B.float(), expected_B, rtol=1e-4, atol=1e-4)
    adv_B = grpo_advantages_B(expected_B.double(), group_index_B(batch.group_ids))
    first_T = batch.cu_seqlens_B1[1:] - 1  # every token of a sequence carries its advantage
    torch.testing.assert_close(prepared.advantages_T[first_T].double(), adv_B, rtol=1e-3, atol=1e-3)
    assert metrics["train/reward_model/score_mean"] == pytest.approx(float(scores_B.mean()), abs=1e-4)
    assert metrics["train/reward_model/reward_mean"] == pytest.approx(float(expected_B.mean()), abs=1e-4)


def test_ppo_critic_returns_read_the_models_score(tmp_path, rm_dir):
    """gamma = lambda = 1, no KL in the reward: every token's return is the sequence's reward, the score's included."""
    trainer = Trainer.init(
        _config(tmp_path, "train.algorithm=ppo", "train.algorithm_kwargs.gae_lambda=1.0", f"reward.model={rm_dir}")
    )
    try:
        batch = trainer.rollout_token_batch(0).batch
        value = trainer.backend.engine.training.runner.prepare(batch)["value"]
    finally:
        trainer.shutdown()
    expected_B = batch.rewards_B.float() + _hf_scores_B(rm_dir, batch)
    mask_T = value.loss_mask_T.bool()
    seq_T = torch.repeat_interleave(torch.arange(batch.num_seqs), batch.seqlens_B)
    torch.testing.assert_close(
        value.extra["returns_T"][mask_T].float(), expected_B[seq_T[mask_T]], rtol=1e-4, atol=1e-4
    )


def test_prompt_only_rows_train_on_the_model_alone_asynchronously(tmp_path, rm_dir):
    """No reward.fn, rows without answers, grpo_async at eta = 1: the rollout's reward is 0, the trained one the score."""
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}:"}) + "\n" for i in range(8)))
    overrides = tiny_run_overrides(tmp_path, num_eval=0)
    overrides = [o for o in overrides if not o.startswith(("reward.fn=", "data.task="))]
    cfg = load_config(
        None,
        overrides
        + [
            "data.task=null",
            f"data.train_path={rows}",
            f"reward.model={rm_dir}",
            "train.algorithm=grpo_async",
            "rollout.max_head_offpolicyness=1",
            "train.steps=3",
        ],
    )
    assert cfg.reward.paths() == []
    steps = _scored_steps(run_to_end(cfg))
    assert len(steps) == 3
    for m in steps:
        assert m["rollout/reward_mean"] == 0.0
        assert m["train/reward_model/reward_mean"] == pytest.approx(m["train/reward_model/score_mean"], abs=1e-6)
        assert m["train/policy/advantage_std"] > 0  # the score varies within groups: the policy has a gradient


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["train.algorithm=sft"], "reward.model: train.algorithm=sft trains offline on dataset rows"),
        (
            ["train.algorithm=opd", "train.algorithm_kwargs.teacher_path=TEACHER"],
            "no role of this recipe trains on rewards",
        ),
        (["train.algorithm=dapo"], "dynamic_sampling_max_rounds=1"),
        (["train.algorithm_kwargs.advantage_estimator=gdpo", "reward.fn=[a:b,c:d]"], "use advantage_estimator=grpo"),
    ],
)
def test_recipes_the_model_cannot_serve_are_refused(tmp_path, rm_dir, extra, message):
    extra = [e.replace("TEACHER", str(rm_dir)) for e in extra]
    with pytest.raises(ConfigError, match=message):
        resolve_recipe(_config(tmp_path, f"reward.model={rm_dir}", *extra))


def test_dapo_filters_on_the_training_side_with_one_round(tmp_path, rm_dir):
    cfg = _config(
        tmp_path,
        f"reward.model={rm_dir}",
        "train.algorithm=dapo",
        "train.algorithm_kwargs.dynamic_sampling_max_rounds=1",
    )
    recipe = resolve_recipe(cfg)
    assert [r.name for r in recipe.roles][-1] == "reward_model" and recipe.reward_syncs[0].weight == 1.0


def test_reward_model_directories_are_checked_before_any_model_loads(tmp_path, rm_dir):
    tok = build_char_tokenizer()
    causal = init_model_dir(tmp_path / "causal", tiny_config(len(tok), **RM_TINY), tok, seed=1)
    with pytest.raises(ModelDirError, match=r"reward.model: .* is a Qwen2ForCausalLM checkpoint, not a reward model"):
        check_run(_config(tmp_path, f"reward.model={causal}"))
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ModelDirError, match="reward.model: .* is a classifier of 2 labels"):
        check_run(_config(tmp_path, f"reward.model={two}"))
    with pytest.raises(ModelDirError, match="reward.model: directory .* does not exist"):
        check_run(_config(tmp_path, f"reward.model={tmp_path / 'nowhere'}"))
    other = save_reward_model(
        tmp_path / "other", tokenizer=build_char_tokenizer(extra_tokens=("<x>",), vocab_padding=0)
    )
    with pytest.raises(ConfigError, match="reward.model: the tokenizer of .* differs from the policy's"):
        check_run(_config(tmp_path, f"reward.model={other}"))
    step = tmp_path / "rmrun" / "checkpoints" / "step_00000002"
    (step / "hf").mkdir(parents=True)
    with pytest.raises(
        ModelDirError, match=r"reward.model: .* is an areno checkpoint, .* pass its Hugging Face export"
    ):
        check_run(_config(tmp_path, f"reward.model={step}"))


def test_settings_it_cannot_take_are_refused(tmp_path, rm_dir):
    with pytest.raises(ConfigError, match="reward.fn: names no function: .* or set reward.model"):
        _config(tmp_path, "reward.fn=[]")
    with pytest.raises(ConfigError, match="reward.model_weight: must be a finite nonzero number"):
        _config(tmp_path, f"reward.model={rm_dir}", "reward.model_weight=0")
    with pytest.raises(ConfigError, match="reward.missing_eos_penalty: lowers reward.model's score .* is unset"):
        _config(tmp_path, "reward.missing_eos_penalty=1.0")
    with pytest.raises(ConfigError, match="reward.missing_eos_penalty: must be a finite number >= 0"):
        _config(tmp_path, f"reward.model={rm_dir}", "reward.missing_eos_penalty=-1.0")


def test_add_model_scores_weighs_each_completions_score_into_its_reward():
    rows = [[_traj([5, 6], [7]), _traj([5, 6], [8, 9])], [_traj([10], [11, 12, 13]), _traj([10], [14])]]
    for reward, t in zip((1.0, 0.0, 0.5, 0.25), (t for ts in rows for t in ts)):
        t.reward = reward
    seen = []

    def score(batch: TokenBatch) -> dict[str, torch.Tensor]:
        seen.append(batch.seqlens_B.tolist())
        return {"reward_model": torch.tensor([2.0, -1.0, 0.0, 4.0])}

    rows[1][0].finish_reason = "length"  # cut at the length limit: the penalty applies
    syncs = (RewardSync(source="reward_model", weight=0.5, missing_eos_penalty=3.0),)
    metrics = add_model_scores(rows, syncs, score)
    assert seen == [[3, 4, 4, 2]]  # one packed batch of every completion, rows in order
    assert [t.reward for ts in rows for t in ts] == [2.0, -0.5, 0.5 - 1.5, 2.25]
    assert [t.info[MODEL_SCORE_INFO_KEY] for ts in rows for t in ts] == [2.0, -1.0, 0.0, 4.0]
    assert metrics == {
        "eval/reward_model/score_mean": 1.25,
        "eval/reward_model/score_std": pytest.approx(float(torch.tensor([2.0, -1.0, 0.0, 4.0]).std(unbiased=False))),
        "eval/reward_model/reward_mean": 0.6875,
    }


def test_held_out_rows_get_the_models_score_in_the_run_and_in_areno_eval(tmp_path, rm_dir):
    """The run's held-out evaluation and ``areno eval`` of its last checkpoint add the same weighted scores (greedy,
    the same weights); the rows file keeps each completion's score beside its reward."""
    cfg = load_config(
        None,
        tiny_run_overrides(tmp_path, num_eval=4)
        + [f"reward.model={rm_dir}", "reward.model_weight=0.5", "train.steps=1"],
    )
    logged = run_to_end(cfg)
    evals = [m for m in logged if "eval/accuracy" in m]
    assert evals and all("eval/reward_model/score_mean" in m for m in evals)
    last = evals[-1]
    summary = run_eval(cfg, EvalOptions(checkpoint="latest"))
    got = summary["metrics"]
    for key in ("eval/accuracy", "eval/reward_model/score_mean", "eval/reward_model/reward_mean"):
        assert got[key] == pytest.approx(last[key], abs=1e-4), key
    assert got["eval/accuracy"] == pytest.approx(got["eval/reward_model/reward_mean"], abs=1e-5)
    rows = [json.loads(line) for line in Path(summary["rows_file"]).read_text().splitlines()]
    for row in rows:
        for completion, reward, score in zip(row["completions"], row["rewards"], row["reward_model_scores"]):
            expected = sevens_and_length(row["prompt"], completion) + 0.5 * score
            assert reward == pytest.approx(expected, abs=1e-5)


def test_the_background_test_rollout_adds_the_models_score_as_areno_eval_does(tmp_path, rm_dir):
    """test_rollout.enabled: its own engine and its own copy of the reward model; the last checkpoint's test/*
    figures equal ``areno eval``'s of that checkpoint (greedy, the same rows)."""
    cfg = load_config(
        None,
        tiny_run_overrides(tmp_path, num_eval=4)
        + [f"reward.model={rm_dir}", "reward.model_weight=0.5", "train.steps=2", "train.eval_interval=0"]
        + ["test_rollout.enabled=true", "test_rollout.interval=1"],
    )
    logged = run_to_end(cfg)
    last = [m for m in logged if m.get("test/step") == 2.0]
    assert last and "test/reward_model/score_mean" in last[0]
    got = run_eval(cfg, EvalOptions(checkpoint="latest"))["metrics"]
    assert last[0]["test/accuracy"] == pytest.approx(got["eval/accuracy"], abs=1e-4)
    assert last[0]["test/reward_model/score_mean"] == pytest.approx(got["eval/reward_model/score_mean"], abs=1e-4)


def test_the_console_shows_the_trained_reward_and_the_models_score():
    sink = ConsoleSink(total_steps=4, stream=io.StringIO(), use_tqdm=False)
    fields = sink.summary(
        {
            "rollout/reward_mean": 0.0,
            "train/reward_model/reward_mean": 1.25,
            "train/reward_model/score_mean": 2.5,
        },
        1,
    )
    assert fields["reward"] == "1.25 (model 2.5)"


def test_the_reward_model_example_then_grpo_on_its_score(tmp_path, monkeypatch):
    """examples/sort_reward_model.yaml, then examples/grpo_reward_model.yaml on its checkpoint, shrunk: the warm
    start (sft, no reward model) and a GRPO step that logs the model's score and the exact match at weight 0."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the examples name their data files from the repository root
    tiny = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"
    quiet = ["observe.console=false", tiny]
    rm = load_config(
        root / "examples/sort_reward_model.yaml",
        [f"run_dir={tmp_path / 'rm'}", f"model.path={tmp_path / 'rm_model'}", "train.steps=2", "rollout.batch_size=4"]
        + ["data.num_eval=4", *quiet],
    )
    run_pipeline(rm)
    written = load_config(root / "examples/grpo_reward_model.yaml").reward.model
    made = load_config(root / "examples/sort_reward_model.yaml")
    assert Path(written) == Path(made.run_dir) / "checkpoints" / f"step_{made.train.steps:08d}" / "hf"
    grpo = load_config(
        root / "examples/grpo_reward_model.yaml",
        [f"run_dir={tmp_path / 'grpo'}", f"model.path={tmp_path / 'policy'}", "train.steps=1", "rollout.batch_size=2"]
        + ["rollout.n_samples=2", "data.num_eval=2", "warm_start.steps=1", *quiet]
        + [
            f"reward.model={tmp_path / 'rm' / 'checkpoints' / 'step_00000002' / 'hf'}",
            "reward.missing_eos_penalty=1.0",
        ],
    )
    run_pipeline(grpo)
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/reward_model/score_mean" in r for r in rows)
    assert any("eval/reward/exact_match_mean" in r for r in rows)
    warm = load_config(tmp_path / "grpo" / "warm_start" / "config.yaml")
    assert warm.reward.model is None and warm.reward.missing_eos_penalty is None
    assert warm.reward.paths() == ["areno.rewards.tasks:exact_match"]


@pytest.mark.slow
def test_a_partitioned_run_scores_on_its_training_worker(tmp_path, rm_dir):
    """cluster.train_devices / rollout_devices: the reward_model role is built in the training worker process, which
    scores the held-out completions too."""
    cfg = load_config(
        None,
        tiny_run_overrides(tmp_path, num_eval=2)
        + [f"reward.model={rm_dir}", "train.steps=2", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"],
    )
    logged = run_to_end(cfg)
    steps = _scored_steps(logged)
    assert any("eval/reward_model/score_mean" in m for m in logged)
    assert len(steps) == 2
    for m in steps:
        assert m["train/reward_model/reward_mean"] == pytest.approx(
            m["rollout/reward_mean"] + m["train/reward_model/score_mean"], abs=1e-4
        )
