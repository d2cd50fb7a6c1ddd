import dataclasses
import sys
from pathlib import Path
from typing import get_type_hints as type_hints

import pytest

from areno.api.config import (
    ArenoConfig,
    ClusterSection,
    ConfigError,
    DataSection,
    ModelSection,
    ObserveSection,
    RewardSection,
    RolloutSection,
    TestRolloutSection,
    TrainSection,
    WarmStartSection,
    load_config,
    to_yaml,
)
from areno.engine.config import (
    Dtypes,
    build_rollout_engine_config,
    build_train_backend_config,
    resolve_dtypes,
    total_optimizer_steps,
)
from areno.errors import describe_type
from areno.models import Decoder, cpu_gemm, tiny_config
from areno.models.hf_io import save_model
from areno.rollout.config import STANDALONE_MAX_NUM_SEQS, RolloutEngineConfig, RolloutEngineSettings
from areno.train.config import LoraConfig, OptimConfig, PrecisionConfig, TrainBackendConfig, TrainStepConfig


def test_defaults_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model:\n  path: /some/model\noptim:\n  lr: 0.001\n")
    cfg = load_config(cfg_file, ["optim.lr=2e-5", "rollout.n_samples=4", "train.algorithm_kwargs.kl_coef=0.1"])
    assert isinstance(cfg, ArenoConfig)
    assert cfg.optim.lr == pytest.approx(2e-5)
    assert cfg.rollout.n_samples == 4
    assert cfg.train.algorithm_kwargs == {"kl_coef": 0.1}
    assert cfg.model.path == "/some/model"
    # the resolved YAML round-trips
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["optim.lrr=1"], "optim.lrr: Key 'lrr' not in 'OptimConfig'. Did you mean: 'lr'?"),
        (["optim.lr=abc"], "optim.lr"),
        (["optim.lr=-1"], "optim.lr: must be > 0"),
        (["rollout.top_p=1.5"], "rollout.top_p: must be in (0, 1]"),
        (["train.steps=1.5"], "train.steps"),
        (["cluster.device=tpu"], "cluster.device"),
        (["noequals"], "must look like key=value"),
        (["train.long_sequences=split"], "train.long_sequences: must be error or truncate"),
        (["train.max_consecutive_skips=-1"], "train.max_consecutive_skips: must be >= 0"),
        (["rollout.decode_steps=-2"], "rollout.decode_steps: must be >= 0"),
        (["rollout.decode_attention=flash"], "rollout.decode_attention: must be auto, gather or paged"),
        (["rollout.request_timeout_s=-1"], "rollout.request_timeout_s: must be >= 0"),
        (["cluster.collective_timeout_s=0"], "cluster.collective_timeout_s: must be > 0"),
        (["train.attention=flash"], "train.attention: must be auto, flex or varlen"),
        (["train.compile_scope=whole"], "train.compile_scope: must be layers or model"),
        (["rollout.fused_projections=maybe"], "rollout.fused_projections"),
        (["optim.betas=[0.9]"], "optim.betas: must be two values in [0, 1)"),
        (["optim.betas=[0.9,1.0]"], "optim.betas: must be two values in [0, 1)"),
        (["optim.eps=0"], "optim.eps: must be > 0"),
        (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio: must be in [0, 1]"),
        (["cluster.train_dp_replicate=2"], "cluster.train_dp_replicate: 2 replicates training"),
        (["observe.wandb_tags=[a]"], "observe.wandb_tags: applies to W&B logging, which is off"),
        (["cluster.sync_timeout_s=0"], "cluster.sync_timeout_s: must be > 0"),
        (["train.role_optim={value: {lrr: 1}}"], "train.role_optim.value.lrr: is not an optim key"),
        (["train.role_optim={value: {lr: -1}}"], "train.role_optim.value.lr: must be > 0"),
        (["train.role_optim={value: {lr: abc}}"], "train.role_optim.value.lr: must be a number, got 'abc'"),
        (["train.role_optim={value: 3}"], "train.role_optim.value: must be a mapping of strings to values, got 3"),
        (["optim.betas=[0.9,b]"], "optim.betas[1]: must be a number, got 'b'"),
        (["cluster.sync_bucket_bytes=1000"], "cluster.sync_bucket_bytes: must be at least 1 MiB"),
        (["observe.wandb_project=p", "observe.wandb_mode=cloud"], "observe.wandb_mode: must be online, offline"),
    ],
)
def test_errors_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=/m", *overrides])
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_sections_built_in_python_take_paths_and_a_lora_mapping(tmp_path):
    """What Python code naturally passes: a ``Path`` where a path string goes, ``train.lora`` as a dict."""
    assert ModelSection(path=tmp_path / "model").path == str(tmp_path / "model")
    assert ArenoConfig(model=ModelSection(path="m"), run_dir=tmp_path / "run").run_dir == str(tmp_path / "run")
    assert TrainSection(lora={"rank": 4}).lora == LoraConfig(rank=4)


@pytest.mark.parametrize(
    "section, kwargs, message",
    [
        (TrainSection, {"steps": "3"}, "train.steps: must be an integer or null, got '3'"),
        (TrainSection, {"steps": 1.5}, "train.steps: must be an integer or null, got 1.5"),
        (TrainSection, {"steps": True}, "train.steps: must be an integer or null, got True"),
        (TrainSection, {"max_tokens_per_mb": "4k"}, "train.max_tokens_per_mb: must be an integer or null, got '4k'"),
        (TrainSection, {"lora": 4}, "train.lora: must be a LoraConfig or null, got 4"),
        (
            TrainSection,
            {"lora": {"rnk": 4}},
            "train.lora.rnk: not a LoRA setting; they are ['rank', 'alpha', 'target_modules', 'dropout']",
        ),
        (LoraConfig, {"rank": 4.0}, "train.lora.rank: must be an integer, got 4.0"),
        (
            LoraConfig,
            {"target_modules": ["q_proj", 1]},
            "train.lora.target_modules: must be a list of strings or a string, got ['q_proj', 1]",
        ),
        (OptimConfig, {"lr": "1e-5"}, "optim.lr: must be a number, got '1e-5'"),
        (OptimConfig, {"betas": [0.9, None]}, "optim.betas: must be a list of numbers, got [0.9, None]"),
        (ObserveSection, {"console": "yes"}, "observe.console: must be true or false, got 'yes'"),
        (ObserveSection, {"profile_steps": 3}, "observe.profile_steps: must be a list of integers, got 3"),
        (RewardSection, {"sandbox": 1}, "reward.sandbox: must be true, false or null, got 1"),
        (DataSection, {"task": 3}, "data.task: must be a string or null, got 3"),
        (DataSection, {"task_kwargs": [1]}, "data.task_kwargs: must be a mapping of strings to values, got [1]"),
        (ModelSection, {"path": 7}, "model.path: must be a string, got 7"),
        (RolloutSection, {"max_model_len": "4k"}, "rollout.max_model_len: must be an integer or null, got '4k'"),
        (RolloutSection, {"cuda_graphs": "no"}, "rollout.cuda_graphs: must be true or false, got 'no'"),
        (
            ClusterSection,
            {"train_devices": [0, "1"]},
            "cluster.train_devices: must be a list of integers or null, got [0, '1']",
        ),
        (WarmStartSection, {"lr": "0.1"}, "warm_start.lr: must be a number, got '0.1'"),
        (TestRolloutSection, {"interval": None}, "test_rollout.interval: must be an integer, got null"),
        (ArenoConfig, {"train": {"steps": 3}}, "train: must be a TrainSection, got {'steps': 3}"),
        (ArenoConfig, {"run_dir": 3}, "run_dir: must be a string, got 3"),
    ],
)
def test_sections_built_in_python_check_their_types(section, kwargs, message):
    """A wrong type is the one-line ConfigError naming the key, before the value checks compare it."""
    with pytest.raises(ConfigError) as info:
        section(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "section, key, value, override",
    [
        (TrainSection, "steps", 1.5, "train.steps=1.5"),
        (TrainSection, "eval_interval", "often", "train.eval_interval=often"),
        (OptimConfig, "lr", "abc", "optim.lr=abc"),
        (ObserveSection, "console", "maybe", "observe.console=maybe"),
        (RolloutSection, "max_new_tokens", None, "rollout.max_new_tokens=null"),
        (DataSection, "task", [1], "data.task=[1]"),
        (ClusterSection, "rollout_devices", 2, "cluster.rollout_devices=2"),
    ],
)
def test_a_wrong_type_reads_alike_from_python_and_from_an_override(section, key, value, override):
    with pytest.raises(ConfigError) as built:
        section(**{key: value})
    with pytest.raises(ConfigError) as loaded:
        load_config(None, ["model.path=/m", override])
    assert str(built.value) == str(loaded.value)
    assert f"must be {describe_type(type_hints(section)[key])}" in str(built.value)


def test_sections_take_what_python_and_yaml_give_for_each_type():
    """Ints for numbers, tuples for lists, numpy integers, null for optional keys, nested sections."""
    import numpy as np

    assert OptimConfig(lr=1, betas=(0.9, 0.99)).betas == (0.9, 0.99)
    assert TrainSection(steps=np.int64(3), max_tokens_per_mb=None, lora=LoraConfig(rank=4)).steps == 3
    assert RolloutSection(generate_during_train=False, servers=[], max_model_len=64).max_model_len == 64
    assert ClusterSection(train_devices=(0,), rollout_devices=[1]).train_devices == (0,)
    cfg = ArenoConfig(model=ModelSection(path="/m"), train=TrainSection(steps=2), resume="auto")
    assert cfg.train.steps == 2 and load_config(None, ["model.path=/m", "train.steps=2", "resume=auto"]) == cfg


def test_missing_model_path_and_file(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, [])


def test_demo_config_parses():
    from areno.api.pipeline import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, ["run_dir=/tmp/x"])
    assert cfg.train.algorithm == "grpo"
    assert cfg.warm_start.steps > 0


def test_demo_config_ships_inside_the_package():
    """``areno demo`` after a plain (non-editable) ``pip install``: its config is package data of a
    package setuptools finds, not a file of the source checkout."""
    import tomllib

    import areno
    from areno.api.pipeline import DEMO_CONFIG

    pkg = Path(areno.__file__).resolve().parent
    assert DEMO_CONFIG.is_relative_to(pkg) and DEMO_CONFIG.exists()
    assert (DEMO_CONFIG.parent / "__init__.py").exists()  # a regular package: packages.find includes it
    pyproject = tomllib.loads((pkg.parent / "pyproject.toml").read_text())
    assert "*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["*"]


# ---------------------------------------------------------------------------- one definition per setting
def _declared_by(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose body declares field ``name``."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_owner_configs_and_sections_share_each_setting_by_inheritance():
    """A setting of the rollout engine or the training backend that the user sets is declared once,
    by its owner; the section extends the owner's class, so name, default, docstring and check are
    the owner's. No field name of an owner config is declared again by the sections it is built from."""
    pairs = [
        (RolloutEngineConfig, [RolloutSection]),
        (TrainBackendConfig, [OptimConfig, TrainSection, ModelSection]),
    ]
    for owner, sections in pairs:
        owner_fields = {f.name for f in dataclasses.fields(owner)}
        for section in sections:
            for f in dataclasses.fields(section):
                if f.name in owner_fields:
                    assert _declared_by(section, f.name) is _declared_by(owner, f.name), (owner, section, f.name)
    assert issubclass(RolloutSection, RolloutEngineSettings) and issubclass(RolloutEngineConfig, RolloutEngineSettings)
    assert issubclass(TrainSection, TrainStepConfig) and issubclass(ModelSection, PrecisionConfig)
    assert ArenoConfig.__dataclass_fields__["optim"].default_factory is OptimConfig


def test_every_engine_and_backend_setting_has_the_same_default_for_the_user():
    for owner, sections in (
        (RolloutEngineSettings, [RolloutSection, RolloutEngineConfig]),
        (TrainStepConfig, [TrainSection, TrainBackendConfig]),
        (OptimConfig, [TrainBackendConfig]),
        (PrecisionConfig, [ModelSection, TrainBackendConfig]),
    ):
        for f in dataclasses.fields(owner):
            for section in sections:
                assert _default(section.__dataclass_fields__[f.name]) == _default(f), (section, f.name)
    user = load_config(None, ["model.path=/m"])
    assert user.rollout.recompute_kv_on_weight_update is RolloutEngineConfig().recompute_kv_on_weight_update is False


def test_sections_reach_the_owner_configs_whole():
    """Every user setting of the engine and the backend arrives, set away from its default."""
    cfg = load_config(
        None,
        [
            "model.path=/m",
            "model.dtype=bfloat16",
            "optim.lr=3e-4",
            "optim.weight_decay=0.01",
            "optim.grad_clip=0",
            "optim.schedule=cosine",
            "optim.warmup_steps=3",
            "optim.min_lr_ratio=0.1",
            "optim.betas=[0.8,0.95]",
            "optim.eps=1e-6",
            "train.max_tokens_per_mb=128",
            "train.activation_checkpointing=true",
            "train.tp_vocab_parallel=false",
            "train.long_sequences=truncate",
            "train.compile=true",
            "train.compile_scope=model",
            "train.attention=flex",
            "train.seed=7",
            "train.max_consecutive_skips=2",
            "train.steps=4",
            "train.num_train_passes=2",
            "train.num_minibatches=3",
            "rollout.recompute_kv_on_weight_update=true",
            "rollout.decode_steps=3",
            "rollout.max_model_len=99",
            "rollout.kv_memory_fraction=0.5",
        ],
    )
    backend = build_train_backend_config(cfg, role_name="actor", trainable=False)
    for section, owner in ((cfg.optim, OptimConfig), (cfg.train, TrainStepConfig), (cfg.model, PrecisionConfig)):
        for f in dataclasses.fields(owner):
            assert getattr(backend, f.name) == getattr(section, f.name), f.name
    assert backend.total_steps == total_optimizer_steps(cfg) == 4 * 2 * 3
    assert (backend.role_name, backend.trainable) == ("actor", False)
    engine = build_rollout_engine_config(cfg, device="cpu", dtype="float32", max_num_seqs=40, num_blocks=12)
    for f in dataclasses.fields(RolloutEngineSettings):
        expected = 40 if f.name == "max_num_seqs" else getattr(cfg.rollout, f.name)
        assert getattr(engine, f.name) == expected, f.name
    assert (engine.device, engine.dtype, engine.num_blocks) == ("cpu", "float32", 12)
    assert build_rollout_engine_config(cfg, device="cpu", dtype="float32", max_num_seqs=8).num_blocks is None


def test_total_optimizer_steps_and_a_warmup_longer_than_the_run():
    cfg = load_config(None, ["model.path=/m", "train.steps=2", "train.num_minibatches=3", "optim.schedule=cosine"])
    assert total_optimizer_steps(cfg) == 6
    assert total_optimizer_steps(load_config(None, ["model.path=/m", "train.steps=0"])) == 1
    with pytest.raises(ConfigError, match=r"optim.warmup_steps: 10 is more than the run's 2 optimizer steps"):
        load_config(None, ["model.path=/m", "train.steps=2", "optim.schedule=cosine", "optim.warmup_steps=10"])
    role = ["train.algorithm=ppo", "train.role_optim={critic: {warmup_steps: 5, schedule: linear_warmup}}"]
    with pytest.raises(ConfigError, match=r"train.role_optim.critic.warmup_steps: 5 is more than"):
        load_config(None, ["model.path=/m", "train.steps=2", *role])


@pytest.mark.parametrize(
    "rollout_dtype, device, expected",
    [
        ("auto", "cuda", "bfloat16"),
        ("auto", "cpu", "float32"),
        ("float32", "cuda", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
    ],
)
def test_resolve_dtypes(rollout_dtype, device, expected):
    cfg = load_config(None, ["model.path=/m", f"model.rollout_dtype={rollout_dtype}", "model.dtype=bfloat16"])
    assert resolve_dtypes(cfg, device) == Dtypes(train="bfloat16", rollout=expected)


@pytest.mark.parametrize(
    "hidden, native, expected",
    [(384, True, "bfloat16"), (128, True, "float32"), (384, False, "float32")],
)
def test_auto_dtypes_on_cpu_take_bfloat16_where_its_gemms_pay(hidden, native, expected, monkeypatch, tmp_path):
    """A wide model on a CPU with native bfloat16 rolls out and computes its forward/backward in bfloat16
    (master weights stay float32); a narrow one, or a CPU that would emulate bfloat16, keeps float32."""
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: native)
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", f"model.init_tiny={{hidden_size: {hidden}}}"])
    assert resolve_dtypes(cfg, "cpu") == Dtypes(train="float32", rollout=expected)
    backend = build_train_backend_config(cfg, role_name="policy", trainable=True)
    assert backend.resolved_param_dtype("cpu") == expected and backend.resolved_param_dtype("cuda") == "bfloat16"
    model_config = tiny_config(50, hidden_size=hidden, layers=1, heads=4, kv_heads=2)
    save_model(Decoder(model_config), model_config, tmp_path / "m")
    no_tiny = load_config(None, [f"model.path={tmp_path / 'm'}"])  # read from the directory's config.json
    assert resolve_dtypes(no_tiny, "cpu").rollout == expected


def test_explicit_dtypes_win_over_auto_on_cpu(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: True)
    wide = ["model.path=/m", "model.init_tiny={hidden_size: 512}"]
    cfg = load_config(None, [*wide, "model.rollout_dtype=float32", "model.compute_dtype=float32"])
    assert resolve_dtypes(cfg, "cpu").rollout == "float32"
    backend = build_train_backend_config(cfg, role_name="policy", trainable=True)
    assert backend.resolved_param_dtype("cpu") == "float32" and backend.resolved_param_dtype("cuda") == "float32"
    with pytest.raises(ConfigError, match="model.compute_dtype: must be one of"):
        load_config(None, [*wide, "model.compute_dtype=fp8"])


def test_engine_config_alone_resolves_its_running_batch():
    assert RolloutEngineSettings().max_num_seqs == 0  # 0: sized by the engine's owner
    assert RolloutEngineConfig().max_num_seqs == STANDALONE_MAX_NUM_SEQS
    assert RolloutEngineConfig(max_num_seqs=7).max_num_seqs == 7
    with pytest.raises(ConfigError, match="rollout.max_tokens_per_step: must be > 0"):
        RolloutEngineConfig(max_tokens_per_step=0)
    with pytest.raises(ConfigError, match="optim.schedule"):
        TrainBackendConfig(schedule="poly")


@pytest.mark.parametrize(
    "key",
    [
        "rollout.cuda_stream=true",  # no gain measured: removed
        "cluster.switch_interval_s=0.001",  # never measured: gone
        "train.host_optimizations=none",
    ],
)
def test_removed_and_internal_settings_are_unknown_keys(key):
    with pytest.raises(ConfigError, match="not in"):
        load_config(None, ["model.path=/m", key])


def _config_like_globals() -> dict[tuple[str, str], object]:
    """Every module-level str / number / bool / None of the loaded areno modules."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name == "areno" or name.startswith("areno."):
            for key, value in vars(module).items():
                if isinstance(value, (str, int, float, bool, type(None))) and not key.startswith("__"):
                    out[(name, key)] = value
    return out


def test_building_from_config_writes_no_module_global(tiny_model_dir, tmp_path):
    """The owners' configs carry every setting: building a run's training backends and rollout engine
    with non-default settings, after a build with the defaults, leaves every module-level value of
    areno as it was."""
    from areno.data.tokenizer import load_pretrained_tokenizer
    from areno.engine.api import build_role_backends, resolve_device, resolve_recipe
    from areno.engine.local import LocalRolloutSide
    from areno.train import LocalTrainBackend

    def build(*overrides: str) -> None:
        cfg = load_config(
            None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "cluster.device=cpu", *overrides]
        )
        build_role_backends(cfg, resolve_recipe(cfg), tiny_model_dir, LocalTrainBackend)
        rollout = LocalRolloutSide(cfg, resolve_device("cpu"))
        rollout.tokenizer = load_pretrained_tokenizer(tiny_model_dir)
        rollout._build_rollout_engine(tiny_model_dir)

    build()  # imports every module the build uses
    before = _config_like_globals()
    build(
        "train.attention=flex",
        "train.compile_scope=model",
        "train.max_consecutive_skips=1",
        "rollout.decode_attention=paged",
        "rollout.fused_projections=false",
        "rollout.cpu_packed_gemm=false",
        "rollout.cuda_graphs=false",
    )
    after = _config_like_globals()
    assert {k: v for k, v in after.items() if k in before and before[k] != v} == {}


def test_rollout_temperature_floor_matches_the_server():
    """A positive temperature below the floor the rollout servers accept is refused at config time,
    not by every request of a partitioned run."""
    from areno.types import MIN_TEMPERATURE

    with pytest.raises(ConfigError, match=r"rollout.temperature: must be 0 \(greedy\) or >= "):
        load_config(None, ["model.path=x", f"rollout.temperature={MIN_TEMPERATURE / 10}"])
    assert (
        load_config(None, ["model.path=x", f"rollout.temperature={MIN_TEMPERATURE}"]).rollout.temperature
        == MIN_TEMPERATURE
    )


def test_role_optim_gives_a_role_its_own_optimizer_settings():
    """PPO's critic with its own learning rate (by its alias), the policy with the ``optim`` section's."""
    from areno.api.preflight import check_role_optim
    from areno.recipes import get_recipe

    cfg = load_config(
        None,
        ["model.path=/m", "train.algorithm=ppo", "optim.lr=1e-6", "train.role_optim={critic: {lr: 1e-5, eps: 1e-6}}"],
    )
    check_role_optim(cfg, get_recipe("ppo"))
    policy = build_train_backend_config(cfg, role_name="policy", trainable=True)
    value = build_train_backend_config(cfg, role_name="value", trainable=True)
    assert (policy.lr, policy.eps) == (1e-6, 1e-8) and (value.lr, value.eps) == (1e-5, 1e-6)
    for algorithm, role_optim, message in (
        ("grpo", "{value: {lr: 1e-5}}", "train.role_optim: role 'value' is not a role of the recipe"),
        ("ppo_kl", "{ref: {lr: 1e-5}}", "train.role_optim.ref: role 'reference' is frozen in 'ppo_kl'"),
        ("ppo", "{value: {lr: 1e-5}, critic: {lr: 1e-4}}", "role 'value' is named twice"),
    ):
        cfg = load_config(None, ["model.path=/m", f"train.algorithm={algorithm}", f"train.role_optim={role_optim}"])
        with pytest.raises(ConfigError, match=message):
            check_role_optim(cfg, get_recipe(algorithm))


@pytest.mark.parametrize(
    "algorithm, overrides, problem",
    [
        ("grpo", ["optim.decay_biases_and_norms=true"], r"optim.decay_biases_and_norms: true does nothing: the weight "
         r"decay of role 'policy' is 0, so nothing decays: set optim.weight_decay > 0 too, or drop it"),
        ("ppo", ["optim.decay_biases_and_norms=true", "train.role_optim={critic: {weight_decay: 0}}"],
         r"optim.decay_biases_and_norms: true does nothing: the weight decay of role 'policy' is 0"),
        ("ppo", ["optim.weight_decay=0.1", "train.role_optim={critic: {decay_biases_and_norms: true, weight_decay: 0}}"],
         r"train.role_optim.critic.decay_biases_and_norms: true does nothing: the weight decay of role 'value' is 0, "
         r"so nothing decays: set train.role_optim.critic.weight_decay > 0 too"),
        ("grpo", ["optim.weight_decay=0.1", "optim.decay_biases_and_norms=true", "train.lora={rank: 4}"],
         r"optim.decay_biases_and_norms: true does nothing: under train.lora role 'policy' trains only its "
         r"adapters' matrices, .*: drop it"),
        ("ppo", ["optim.weight_decay=0.1", "train.lora={rank: 4}", "train.role_optim={actor: {decay_biases_and_norms: true}}"],
         r"train.role_optim.actor.decay_biases_and_norms: true does nothing: under train.lora"),
    ],
)  # fmt: skip
def test_decay_biases_and_norms_that_decays_nothing_is_refused(algorithm, overrides, problem):
    from areno.api.preflight import check_decay_biases_and_norms
    from areno.recipes import get_recipe

    cfg = load_config(None, ["model.path=/m", f"train.algorithm={algorithm}", *overrides])
    with pytest.raises(ConfigError, match=problem):
        check_decay_biases_and_norms(cfg, get_recipe(algorithm))


@pytest.mark.parametrize(
    "algorithm, overrides",
    [
        ("grpo", ["optim.weight_decay=0.1", "optim.decay_biases_and_norms=true"]),
        # the policy's decay spares nothing under LoRA, but the critic's value head trains in full, its bias too
        ("ppo", ["optim.weight_decay=0.1", "optim.decay_biases_and_norms=true", "train.lora={rank: 4}"]),
        # the critic alone decays (its own weight decay); the policy takes the optim section's 0
        ("ppo", ["optim.decay_biases_and_norms=true", "train.role_optim={critic: {weight_decay: 0.1}}"]),
        ("ppo", ["train.role_optim={critic: {weight_decay: 0.1, decay_biases_and_norms: true}}"]),
    ],
)
def test_decay_biases_and_norms_that_decays_something_is_accepted(algorithm, overrides):
    from areno.api.preflight import check_decay_biases_and_norms
    from areno.recipes import get_recipe

    cfg = load_config(None, ["model.path=/m", f"train.algorithm={algorithm}", *overrides])
    check_decay_biases_and_norms(cfg, get_recipe(algorithm))
