"""Settings that would do nothing where they are given are refused with one line naming the key and the
fix; a demo run made with other settings is made again, not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from areno.api.config import load_config
from areno.api.pipeline import _changed, run_pipeline, warm_start_config, warm_start_settings
from areno.api.preflight import check_run
from areno.engine.api import prepare_model_dir
from areno.errors import ConfigError
from tests.helpers.configs import TINY, tiny_run_overrides

BASE = ["model.path=/m"]


def _refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*BASE, *overrides])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.train_path=rows.jsonl"], r"data.train_path: is set but data.task='arithmetic' generates the rows"),
        (["data.eval_path=rows.jsonl"], r"data.eval_path: .*set data.task=null to read the file"),
        (["data.task=null", "data.train_path=r.jsonl", "data.task_kwargs={max_digits: 2}"], r"data.task_kwargs"),
        (["rollout.top_k=0"], r"rollout.top_k: must be -1 \(off\) or >= 1, got 0"),
        (["rollout.max_retries=-1"], r"rollout.max_retries: must be >= 0"),
        (["rollout.server_args=[--enforce-eager]"], r"rollout.server_args: configures vLLM/SGLang servers"),
        (["optim.warmup_steps=5"], r"optim.warmup_steps: the constant schedule has no warm-up"),
        (["optim.min_lr_ratio=0.1"], r"optim.min_lr_ratio: .*set it to cosine"),
        (["resume=auto", "overwrite=true"], r"overwrite: .*resume=auto continues it"),
        (["cluster.sync_commit=inplace"], r"cluster.sync_commit: applies to the policy sync .* partitioned run"),
        (["cluster.sync_timeout_s=5"], r"cluster.sync_timeout_s: "),
        (["rollout.generate_during_train=true"], r"rollout.generate_during_train: true .* synchronous"),
    ],
)
def test_settings_that_would_do_nothing_are_refused(overrides, match):
    _refused(overrides, match)


SERVERS = ["rollout.backend=vllm", "cluster.device=cuda"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.block_size=8"], r"rollout.block_size: =8 configures areno's own rollout engine, which a vllm"),
        (["rollout.kv_blocks=100"], r"rollout.kv_blocks: "),
        (["rollout.cuda_graph_warmup=false"], r"rollout.cuda_graph_warmup: "),
        (["rollout.top_p=0.9"], r"rollout.top_p: vLLM reports log-probs of the truncated distribution"),
        (["rollout.top_k=20"], r"rollout.top_k: .*use rollout.top_k=-1 with vllm"),
        (
            ["rollout.servers=[http://h:8000]", "rollout.server_args=[-x]"],
            r"rollout.server_args: applies to the servers",
        ),
        (["rollout.servers=[http://h:8000]", "rollout.max_model_len=512"], r"rollout.max_model_len: applies"),
    ],
)
def test_the_embedded_engines_settings_are_refused_with_servers(overrides, match):
    _refused([*SERVERS, *overrides], match)


def test_server_settings_that_do_apply_are_accepted():
    cfg = load_config(None, [*BASE, *SERVERS, "rollout.max_model_len=512", "rollout.server_args=[--enforce-eager]"])
    assert cfg.rollout.max_model_len == 512
    cfg = load_config(None, [*BASE, "rollout.max_head_offpolicyness=2", "rollout.generate_during_train=true"])
    assert cfg.rollout.generate_during_train is True


def test_a_partitioned_run_keeps_its_sync_settings_and_refuses_profiling():
    parts = ["cluster.train_devices=[0]", "cluster.rollout_devices=[1]", "cluster.device=cpu"]
    cfg = load_config(None, [*BASE, *parts, "cluster.sync_commit=inplace", "cluster.sync_timeout_s=5"])
    assert (cfg.cluster.sync_commit, cfg.cluster.sync_timeout_s) == ("inplace", 5)
    _refused([*parts, "observe.profile_steps=[1]"], r"observe.profile_steps: profiles the trainer's process")


def _checked(tmp_path, *extra: str) -> None:
    """check_run of a tiny config (its model is made at start-up: no file is needed)."""
    check_run(load_config(None, [*tiny_run_overrides(tmp_path), *extra]))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.num_minibatches=9"], r"train.num_minibatches=9 is more than the 8 sequences of a step"),
        (["train.algorithm=sft", "train.num_minibatches=3"], r"more than the 2 sequences .*\(rollout.batch_size\)"),
        (["test_rollout.enabled=true", "data.num_eval=0"], r"test_rollout.enabled: there are no held-out rows"),
        (
            ["train.algorithm=sft", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"],
            r"train.algorithm='sft' trains offline .* but cluster.train_devices / cluster.rollout_devices would "
            r"partition the run: unset it",
        ),
        (
            ["train.algorithm=sft", "cluster.allocation_mode='vllm:d1+fsdp:d1'"],
            r"train.algorithm='sft' trains offline .* but cluster.allocation_mode='vllm:d1\+fsdp:d1' would partition",
        ),
        (["reward.sandbox=false", "reward.memory_mb=512"], r"reward.memory_mb bounds the reward's sandbox workers"),
        (
            ["reward.fn=areno.rewards.tasks:exact_match", "reward.workers=2"],
            r"reward.workers .*exact_match is cheap and safe in-process",
        ),
    ],
)
def test_preflight_refuses_what_a_recipe_or_reward_cannot_use(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        _checked(tmp_path, *overrides)


def test_the_warm_start_leaves_out_what_only_the_main_stage_uses(tmp_path):
    cfg = load_config(
        None,
        [
            *tiny_run_overrides(tmp_path),
            "train.algorithm=ppo",
            "train.role_optim={critic: {lr: 1e-5}}",
            "train.steps=3",
            "observe.profile_steps=[3]",
            "warm_start.steps=2",
        ],
    )
    sft = warm_start_config(cfg)  # the critic's optimizer and step 3's profile belong to the main stage
    assert (sft.train.role_optim, sft.observe.profile_steps, sft.test_rollout.enabled) == ({}, [], False)
    check_run(sft)


def test_a_tiny_model_of_other_arguments_is_made_again(tmp_path):
    overrides = [f"model.path={tmp_path / 'model'}", TINY]
    first = prepare_model_dir(load_config(None, overrides))
    weights = load_file(first / "model.safetensors")
    prepare_model_dir(load_config(None, overrides))  # the same arguments: kept
    assert all((load_file(first / "model.safetensors")[k] == v).all() for k, v in weights.items())
    prepare_model_dir(load_config(None, [*overrides, "train.seed=1"]))
    assert json.loads((first / "areno_init_tiny.json").read_text())["seed"] == 1
    again = load_file(first / "model.safetensors")
    assert any((again[k] != v).any() for k, v in weights.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # made beside it, moved in whole
    # a run that resumes keeps the model its checkpoints came from
    (tmp_path / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    resumed = [*overrides, f"run_dir={tmp_path / 'run'}", "resume=auto", "train.seed=2"]
    prepare_model_dir(load_config(None, resumed))
    assert json.loads((first / "areno_init_tiny.json").read_text())["seed"] == 1


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_a_finished_warm_start_is_reused_only_with_its_settings(tmp_path, capsys):
    def run(*extra: str) -> None:
        overrides = [*tiny_run_overrides(tmp_path), "train.steps=1", "warm_start.steps=1", "warm_start.batch_size=4"]
        run_pipeline(load_config(None, [*overrides, "overwrite=true", *extra]))

    run()
    complete = tmp_path / "run" / "warm_start" / "final_model" / "COMPLETE"
    made = complete.stat().st_mtime_ns
    run("train.eval_interval=1")  # what the main stage evaluates leaves the warm start as it is
    assert complete.stat().st_mtime_ns == made and "training it again" not in capsys.readouterr().out
    run("train.max_tokens_per_mb=512", "model.rollout_dtype=float32")  # how fast it trains, how the policy rolls out
    assert complete.stat().st_mtime_ns == made and "training it again" not in capsys.readouterr().out
    run("warm_start.lr=0.01")
    assert "was made with other settings (optim.lr): training it again" in capsys.readouterr().out
    again = complete.stat().st_mtime_ns
    assert again != made
    # a resumed run keeps the warm start its checkpoints came from, the change warned about
    overrides = [*tiny_run_overrides(tmp_path), "train.steps=2", "warm_start.steps=1", "warm_start.batch_size=4"]
    run_pipeline(load_config(None, [*overrides, "resume=true", "warm_start.lr=0.02"]))
    assert complete.stat().st_mtime_ns == again and "training it again" not in capsys.readouterr().out


def test_a_warm_start_that_decayed_its_biases_and_norms_is_made_again_only_where_it_decayed():
    """An older areno decayed every weight and recorded no ``decay_biases_and_norms``: its warm start is
    stale where it had weight decay (biases and norms are spared now), the same where it had none."""
    base = ["model.path=/m", "warm_start.steps=1"]
    for decay, stale in (("0.1", ["optim.decay_biases_and_norms"]), ("0.0", [])):
        now = warm_start_settings(warm_start_config(load_config(None, [*base, f"optim.weight_decay={decay}"])))
        older = {name: {k: v for k, v in keys.items() if k != "decay_biases_and_norms"} for name, keys in now.items()}
        assert _changed(older, now) == stale
    asked = load_config(None, [*base, "optim.weight_decay=0.1", "optim.decay_biases_and_norms=true"])
    assert warm_start_settings(warm_start_config(asked))["optim"]["decay_biases_and_norms"] is True


def test_the_warm_start_takes_decay_biases_and_norms_only_where_it_decays():
    """A critic's own weight decay makes the main stage's decay_biases_and_norms do something; the warm
    start (sft: the policy alone, role_optim dropped, at weight decay 0) leaves it out instead of refusing
    the run as if the user had set it there."""
    from areno.api.preflight import check_decay_biases_and_norms
    from areno.recipes import get_recipe

    base = ["model.path=/m", "warm_start.steps=1", "optim.decay_biases_and_norms=true"]
    cfg = load_config(None, [*base, "train.algorithm=ppo", "train.role_optim={critic: {weight_decay: 0.1}}"])
    check_decay_biases_and_norms(cfg, get_recipe("ppo"))
    sft = warm_start_config(cfg)
    assert sft.optim.decay_biases_and_norms is False
    check_decay_biases_and_norms(sft, get_recipe("sft"))
    decayed = warm_start_config(load_config(None, [*base, "optim.weight_decay=0.1"]))
    assert decayed.optim.decay_biases_and_norms is True  # where the warm start decays, as the main stage asked


def test_the_warm_start_takes_a_main_stage_cosine_schedule(tmp_path):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "optim.schedule=cosine", "optim.min_lr_ratio=0.1"])
    assert warm_start_config(cfg).optim.min_lr_ratio == 0.0


def test_a_roles_optimizer_is_checked_over_the_optim_section():
    base = ["model.path=/m", "train.algorithm=ppo", "train.steps=20", "optim.schedule=cosine"]
    cfg = load_config(None, [*base, "train.role_optim={critic: {warmup_steps: 5, min_lr_ratio: 0.1}}"])
    assert cfg.train.role_optim["critic"]["warmup_steps"] == 5
    with pytest.raises(ConfigError, match=r"train.role_optim.critic \(over the optim section\): optim.warmup_steps"):
        load_config(None, [*base, "optim.warmup_steps=10", "train.role_optim={critic: {schedule: constant}}"])
    with pytest.raises(ConfigError, match=r"^train.role_optim.critic.lr: must be > 0"):
        load_config(None, [*base, "train.role_optim={critic: {lr: -1}}"])


def test_a_resumed_run_keeps_its_task_and_is_quiet_about_resume(tmp_path, caplog):
    from areno.api.config import to_yaml
    from areno.api.preflight import check_resumed_config

    base = [f"run_dir={tmp_path}", "model.path=/m", "data.task_kwargs={max_digits: 2}"]
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(None, base)))
    with caplog.at_level("WARNING"):
        check_resumed_config(load_config(None, [*base, "resume=auto"]))
    assert "settings changed" not in caplog.text
    with caplog.at_level("WARNING"):
        check_resumed_config(load_config(None, [*base, "resume=auto", "reward.fn=tests.helpers.rewards:sevens"]))
    assert "reward.fn: 'areno.rewards.tasks:exact_match' -> 'tests.helpers.rewards:sevens'" in caplog.text
    with pytest.raises(ConfigError, match=r"data.task_kwargs.max_digits=2, which a resumed run cannot change"):
        check_resumed_config(load_config(None, [*base[:2], "data.task_kwargs={max_digits: 3}", "resume=auto"]))


def test_areno_demo_resumes_when_asked(monkeypatch, tmp_path):
    from areno.api import pipeline

    seen = []
    monkeypatch.setattr(
        pipeline, "run_pipeline", lambda cfg: seen.append(cfg) or {"accuracy_before": 0, "accuracy_after": 0}
    )
    pipeline.run_demo(run_dir=str(tmp_path), overrides=["resume=auto"])
    pipeline.run_demo(run_dir=str(tmp_path))
    pipeline.run_demo(run_dir=str(tmp_path), overrides=["resume=false"])  # starts over, as without it
    assert [(c.resume, c.overwrite) for c in seen] == [("auto", False), (False, True), (False, True)]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["cluster.allocation_mode=areno:d1t2+fsdp:d1"],
            r"cluster.allocation_mode=.*\(t2\): .*does not divide num_key_value_heads=1",
        ),
        (["cluster.train_devices=[0,0]", "cluster.rollout_devices=[1]"], r"repeats"),
    ],
)
def test_a_partitioned_layout_is_checked_before_the_warm_start(tmp_path, overrides, match):
    """Preflight plans the layout and checks its TP sizes against the model (from init_tiny: none is made)."""
    from areno.errors import UserError

    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "warm_start.steps=3", *overrides])
    with pytest.raises(UserError, match=match):
        run_pipeline(cfg)
    assert not (tmp_path / "run" / "warm_start").exists() and not (tmp_path / "model").exists()


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    from areno.cli import main
    from tests.helpers.configs import train_args

    (tmp_path / "afile").write_text("")
    for run_dir in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main([*train_args(tmp_path), f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"run_dir {run_dir}: cannot write there" in err[0], err
        assert "pick a writable directory" in err[0]
    assert not (tmp_path / "model").exists()  # before the model was made


def test_rows_and_rewards_that_cannot_meet_are_refused_before_the_model(tmp_path, capsys):
    """A reward that cannot take the workflows' call, rows without the answer an answer-scoring reward
    needs, an empty prompt, an empty held-out file, message lists without a chat template."""
    from areno.cli import main
    from tests.helpers.configs import train_args

    rows = tmp_path / "rows.jsonl"
    cases = [
        (
            ['{"prompt": "1+1=", "answer": "2"}'],
            ["reward.fn=tests.core.test_config_refusals:two_args"],
            "takes (prompt, completion)",
        ),
        (['{"prompt": "1+1=", "solution": "2"}'], ["reward.fn=areno.rewards.tasks:exact_match"], "no field 'answer'"),
        (['{"prompt": "", "answer": "2"}'], [], "line 1: 'prompt' is an empty string"),
        (['{"prompt": "   ", "answer": "2"}'], [], "line 1: 'prompt' is whitespace only"),
        (
            ['{"prompt": [{"role": "user", "content": "hi"}], "answer": "2"}'],
            [],
            "line 1: 'prompt' is a message list, which needs a chat",
        ),
        (
            ['{"prompt": "1+1=", "answer": "2"}'],
            [f"data.eval_path={tmp_path / 'empty.jsonl'}"],
            "empty.jsonl holds no rows",
        ),
        (
            ['{"prompt": "1+1=", "answer": "2"}'],
            [f"data.eval_path={tmp_path / 'long.jsonl'}", "rollout.max_model_len=64"],
            "long.jsonl line 2: the prompt has 100 tokens but the context is 64",
        ),
        (
            ['{"prompt": "1+1=", "answer": "2"}'],
            ["rollout.workflow=areno.workflows.env:arithmetic_retry_workflow", "data.system_prompt=Be brief."],
            "data.system_prompt is set but rollout.workflow=areno.workflows.env:arithmetic_retry_workflow renders its "
            "own prompts",
        ),
        (
            ['{"prompt": "1+1=", "answer": "2"}'],
            ["rollout.max_model_len=100000"],
            "rollout.max_model_len=100000 exceeds the model's max_position_embeddings=",
        ),
    ]
    (tmp_path / "empty.jsonl").write_text("\n")
    short, long = {"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 100, "answer": "2"}
    (tmp_path / "long.jsonl").write_text(f"{json.dumps(short)}\n{json.dumps(long)}\n")
    for lines, extra, message in cases:
        rows.write_text("\n".join(lines) + "\n")
        args = train_args(tmp_path, "data.task=null", f"data.train_path={rows}", "reward.sandbox=false", *extra)
        assert main(args) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (message, err)
    assert not (tmp_path / "model").exists()  # all before the model was made


def two_args(prompt, completion):
    return 1.0


def test_an_override_empties_a_mapping_a_file_set(tmp_path):
    """walk31: with demo.yaml's data.task_kwargs, `data.task=null data.train_path=...` had no override that
    worked: `=null` was refused as no mapping, `={}` merged and kept the file's keys."""
    demo = Path(__file__).resolve().parents[2] / "areno" / "configs" / "demo.yaml"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    file_only = ["data.task=null", f"data.train_path={rows}"]
    with pytest.raises(ConfigError, match=r"unset data.task_kwargs \(data.task_kwargs=null on the command line\)"):
        load_config(demo, file_only)
    for value in ("null", "{}"):
        assert load_config(demo, [*file_only, f"data.task_kwargs={value}"]).data.task_kwargs == {}
        # in order: emptied, then a key set (walk32: the emptying ran last and dropped it)
        replaced = load_config(demo, [f"data.task_kwargs={value}", "data.task_kwargs.max_len=9"]).data.task_kwargs
        assert replaced == {"max_len": 9}
    assert load_config(demo, ["model.init_tiny=null"]).model.init_tiny is None  # an optional mapping: None


def test_overrides_may_follow_options():
    from areno.cli import _parse, build_parser

    args = _parse(build_parser(), ["train", "c.yaml", "--algorithm", "ppo", "run_dir=x", "train.steps=2"])
    assert (args.config, args.algorithm, args.overrides) == ("c.yaml", "ppo", ["run_dir=x", "train.steps=2"])
    args = _parse(build_parser(), ["eval", "c.yaml", "--checkpoint", "latest", "run_dir=x"])
    assert (args.checkpoint, args.overrides) == ("latest", ["run_dir=x"])
    with pytest.raises(SystemExit):
        _parse(build_parser(), ["train", "c.yaml", "--bogus"])


def test_a_run_saved_with_relative_paths_resumes_from_its_directory(tmp_path, monkeypatch):
    from areno.api.config import absolute_paths, to_yaml
    from areno.api.preflight import check_resumed_config

    # config.yaml of a run made before paths were written absolute, resumed from the same directory
    monkeypatch.chdir(tmp_path)
    relative = ["run_dir=run", "model.path=model", "data.task=null", "data.train_path=rows.jsonl"]
    (tmp_path / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(load_config(None, relative)))
    check_resumed_config(absolute_paths(load_config(None, [*relative, "resume=auto"])))
    with pytest.raises(ConfigError, match=r"data.train_path='.*/rows.jsonl', which a resumed run cannot change"):
        check_resumed_config(
            absolute_paths(load_config(None, [*relative[:3], "data.train_path=other.jsonl", "resume=auto"]))
        )


@pytest.mark.parametrize(
    "saved, problem",
    [
        (None, "holds checkpoints but no config.yaml, without which a resumed run cannot check"),
        ("model: [unclosed", r"config.yaml is unreadable \(ParserError: "),
        ("", r"config.yaml is unreadable \(it holds no run settings\)"),
    ],
    ids=["missing", "garbage", "empty"],
)
def test_a_resumed_run_without_its_config_yaml_is_refused(tmp_path, saved, problem):
    """walk31: without run_dir/config.yaml a resume with another algorithm or data went on silently; a damaged
    one was a 46-line traceback or a wrong diagnosis (every setting None)."""
    from areno.api.preflight import check_resumed_config

    args = [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", "data.task=arithmetic", "resume=auto"]
    (tmp_path / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    if saved is not None:
        (tmp_path / "run" / "config.yaml").write_text(saved)
    with pytest.raises(ConfigError, match=problem):
        check_resumed_config(load_config(None, args))


@pytest.mark.parametrize(
    "override, problem",
    [
        ("cluster.role_devices={ref:[2]}", "found unexpected ':' at column 5 of the value"),
        ("cluster.train_devices=[0", "did not find expected ',' or ']'"),
    ],
)
def test_an_override_whose_value_is_not_yaml_is_one_line(override, problem):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=/m", override])
    message = str(info.value)
    assert message.startswith(f"override {override!r}: its value is not valid YAML ({problem}")
    assert "\n" not in message and "a space after each ':'" in message


def test_a_run_saved_before_a_key_existed_resumes_quietly_and_keeps_its_order(tmp_path, caplog):
    """A key areno added since the run was saved (``data.shuffle``, ``observe.log_completions``) read as changed
    from None in every resumed run's warning, and ``data.shuffle`` would have refused it; the saved run had the
    default. Turning the shuffle off on resume changes the data order: refused, as ``data.seed`` is."""
    import yaml

    from areno.api.config import to_yaml
    from areno.api.preflight import check_resumed_config

    base = [f"run_dir={tmp_path}", "model.path=/m"]
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    saved = yaml.safe_load(to_yaml(load_config(None, base)))
    del saved["data"]["shuffle"], saved["observe"]["log_completions"]  # a config.yaml of an older areno
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with caplog.at_level("WARNING"):
        check_resumed_config(load_config(None, [*base, "resume=auto"]))
    assert "settings changed" not in caplog.text
    with pytest.raises(ConfigError, match=r"data.shuffle=True, which a resumed run cannot change"):
        check_resumed_config(load_config(None, [*base, "resume=auto", "data.shuffle=false"]))
