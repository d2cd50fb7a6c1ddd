"""Config keys reach what they shape: the colocated rollout engine (``LocalRolloutSide._build_rollout_engine``)
and the training forwards' CUDA attention (``build_role_backends``)."""

import pytest

from areno.api.config import load_config
from areno.data.tokenizer import load_pretrained_tokenizer
from areno.engine.api import resolve_device
from areno.engine.local import LocalRolloutSide


def _colocated_engine(cfg, model_dir):
    """The engine ``LocalRolloutSide`` builds for ``cfg`` on the CPU."""
    colocated = LocalRolloutSide(cfg, resolve_device("cpu"))
    colocated.tokenizer = load_pretrained_tokenizer(model_dir)  # what start() sets before building the engine
    return colocated._build_rollout_engine(model_dir)


@pytest.mark.parametrize("fused", [True, False])
def test_rollout_keys_reach_the_colocated_engine(tiny_model_dir, tmp_path, fused):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "cluster.device=cpu",
            f"rollout.fused_projections={str(fused).lower()}",
            "rollout.cuda_graphs=false",
            f"rollout.prefill_cuda_graphs={str(fused).lower()}",
            "rollout.decode_steps=3",
            "rollout.kv_blocks=32",
            "rollout.max_num_seqs=40",
            f"rollout.recompute_kv_on_weight_update={str(not fused).lower()}",
            f"rollout.mixed_decode_min_rows={4 if fused else 'null'}",
            f"rollout.enable_prefix_sharing={str(fused).lower()}",
            "rollout.max_tokens_per_step=96",
        ],
    )
    engine = _colocated_engine(cfg, tiny_model_dir)
    assert engine.model.projections_fused is fused
    assert engine.config.fused_projections is fused and engine.config.cuda_graphs is False
    assert engine.config.prefill_cuda_graphs is fused and engine._stepper.prefill_graphs is None  # CPU: none
    assert engine.decode_steps == 3 and engine.allocator.num_blocks == 32
    assert engine.scheduler.max_num_seqs == 40 and engine.config.cuda_graph_max_batch is None  # graphs: up to 40
    assert engine.config.recompute_kv_on_weight_update is (not fused)
    assert engine.config.mixed_decode_min_rows == (4 if fused else None)
    assert engine.config.enable_prefix_sharing is fused and engine.config.max_tokens_per_step == 96


def test_decode_steps_default_is_eight_on_cpu(tiny_model_dir, tmp_path):
    """``rollout.decode_steps`` unset (0 = engine default): 8 decode steps per round trip on CPU as on CUDA."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "cluster.device=cpu"])
    engine = _colocated_engine(cfg, tiny_model_dir)
    assert cfg.rollout.decode_steps == 0 and engine.decode_steps == 8


def test_cuda_graph_max_batch_defaults_to_the_running_batch_and_is_validated():
    from areno.rollout.engine import RolloutEngineConfig

    assert RolloutEngineConfig(max_num_seqs=512).cuda_graph_max_batch is None
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        RolloutEngineConfig(cuda_graph_max_batch=0)


def test_mixed_decode_min_rows_is_validated():
    with pytest.raises(ValueError, match="rollout.mixed_decode_min_rows"):
        load_config(None, ["model.path=m", "rollout.mixed_decode_min_rows=0"])


@pytest.mark.parametrize("choice", ["varlen", "flex", "auto"])
def test_train_attention_reaches_the_trained_models(tiny_model_dir, tmp_path, choice):
    """`train.attention` is each training backend's model's choice (``Decoder.cuda_attention``), not a
    process-wide setting: a second run in the process with another value does not change the first's."""
    from areno.engine.api import build_role_backends, resolve_recipe
    from areno.models.decoder import Decoder
    from areno.train import LocalTrainBackend

    def backends(attention: str) -> dict:
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"run_dir={tmp_path / 'run'}",
                "cluster.device=cpu",
                f"train.attention={attention}",
            ],
        )
        return build_role_backends(cfg, resolve_recipe(cfg), tiny_model_dir, LocalTrainBackend)

    first = backends(choice)
    other = backends("flex" if choice != "flex" else "varlen")
    for built, attention in ((first, choice), (other, "flex" if choice != "flex" else "varlen")):
        decoders = [m for b in built.values() for m in b.model.modules() if isinstance(m, Decoder)]
        assert decoders and all(d.cuda_attention == attention for d in decoders)
    assert Decoder.cuda_attention == "auto"  # the class default: untouched


@pytest.mark.parametrize("choice", ["true", "false", "auto"])
def test_train_share_prompts_reaches_the_trained_models(tiny_model_dir, tmp_path, choice):
    """`train.share_prompts` is each trained model's ``Decoder.share_prompts`` (auto: on where it applies)."""
    from areno.engine.api import build_role_backends, resolve_recipe
    from areno.models.decoder import Decoder
    from areno.train import LocalTrainBackend

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "cluster.device=cpu",
            f"train.share_prompts={choice}",
        ],
    )
    built = build_role_backends(cfg, resolve_recipe(cfg), tiny_model_dir, LocalTrainBackend)
    decoders = [m for b in built.values() for m in b.model.modules() if isinstance(m, Decoder)]
    assert decoders and all(d.share_prompts is (choice != "false") for d in decoders)
    assert Decoder.share_prompts is False  # the class default: untouched


def test_train_compile_scope_reaches_the_training_backend(tiny_model_dir, tmp_path, caplog):
    """`train.compile_scope=model` compiles each trained role's layer stack as one callable (the
    compile itself happens at the first forward, which the log announces)."""
    from areno.engine.api import build_role_backends, resolve_recipe
    from areno.train import LocalTrainBackend

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "cluster.device=cpu",
            "train.compile=true",
            "train.compile_scope=model",
        ],
    )
    with caplog.at_level("INFO", logger="areno.engine.api"):
        backends = build_role_backends(cfg, resolve_recipe(cfg), tiny_model_dir, LocalTrainBackend)
    assert "compile_scope=model) during the first training step" in caplog.text
    backend = next(iter(backends.values()))
    assert backend.cfg.compile_scope == "model"
    assert "forward_layers" in vars(backend.model)


def test_block_size_reaches_the_engine_and_decides_what_a_short_prompt_shares(tiny_model_dir, tmp_path):
    """``rollout.block_size``: the KV pool's block (``kv_blocks`` count them) and the unit of prefix
    sharing. A group of samples of a 9-token prompt shares its first 8 tokens with 8-token blocks and
    nothing with 16-token ones (the default): the CPU demo's case."""
    from areno.rollout.sampling import SamplingParams

    prompt = list(range(3, 12))
    hits = {}
    for size in (8, 16):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"run_dir={tmp_path / f'run{size}'}",
                "cluster.device=cpu",
                "rollout.kv_blocks=64",
                f"rollout.block_size={size}",
            ],
        )
        engine = _colocated_engine(cfg, tiny_model_dir)
        assert engine.config.block_size == size and engine.cache.block_size == size
        assert engine.allocator.num_blocks == 64
        outs = engine.generate([prompt] * 8, SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len({tuple(o.output_ids) for o in outs}) == 1  # greedy: shared or not, the same tokens
        hits[size] = engine.allocator.prefix_hit_tokens
    assert hits == {8: 7 * 8, 16: 0}
    with pytest.raises(ValueError, match="rollout.block_size: must be > 0, got 0"):
        load_config(None, ["model.path=m", "rollout.block_size=0"])
    assert load_config(None, ["model.path=m"]).rollout.block_size == 16
