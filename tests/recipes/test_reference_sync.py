"""``train.algorithm_kwargs.ref_sync_steps`` / ``ref_sync_alpha`` (TRL's ``sync_ref_model``,
``ref_model_sync_steps``, ``ref_model_mixup_alpha``): every N optimizer steps of the policy, the frozen
reference becomes alpha * policy + (1 - alpha) * reference. Refused in one line where it cannot apply,
the mixing checked against a hand computation on a tiny model, a resumed run's reference against an
uninterrupted run's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areno.api.config import load_config
from areno.api.preflight import check_reference_sync
from areno.cli import main as areno_main
from areno.engine.api import resolve_recipe
from areno.errors import ConfigError
from areno.models.hf_io import load_model
from areno.recipes import get_recipe
from areno.recipes.config import ModelRole, ReferenceSync
from areno.recipes.runner import RecipeRunner
from areno.specializations import LogProbSpecialization
from areno.train import LocalTrainBackend, TrainBackendConfig
from areno.train.checkpoint import load as load_checkpoint
from tests.helpers.configs import resumable_run, run_to_end, tiny_run_overrides, train_args
from tests.helpers.recipes import rl_batch_for, tiny_policy_dir

KEY = "train.algorithm_kwargs."


@pytest.mark.parametrize(
    ("name", "kwargs", "says"),
    [
        ("grpo", {"ref_sync_steps": 4}, "recipe 'grpo' has none at kl_coef=0: set train.algorithm_kwargs.kl_coef > 0"),
        ("dapo", {"ref_sync_steps": 4}, "recipe 'dapo' has none: drop it, or use a recipe with one"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_alpha": 0.5}, "ref_sync_alpha=0.5 does nothing while ref_sync_steps is 0"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_steps": -1}, "ref_sync_steps must be >= 0"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_steps": 2, "ref_sync_alpha": 0.0}, "ref_sync_alpha must be in (0, 1]"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_steps": 2, "ref_sync_alpha": 1.5}, "ref_sync_alpha must be in (0, 1]"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_steps": "often"}, "ref_sync_steps: must be an integer"),
        ("grpo", {"kl_coef": 0.04, "ref_sync_step": 2}, "did you mean 'ref_sync_steps'?"),
    ],
)
def test_a_sync_that_cannot_apply_is_refused_in_one_line(name, kwargs, says):
    with pytest.raises(ConfigError) as info:
        get_recipe(name, policy_kwargs=kwargs)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("grpo", {"kl_coef": 0.04, "ref_sync_steps": 512}),
        ("reinforce_pp", {"ref_sync_steps": 8, "ref_sync_alpha": 0.9}),
        ("ppo_kl", {"ref_sync_steps": 8}),
        ("dpo", {"ref_sync_steps": 8, "ref_sync_alpha": 1.0}),  # TR-DPO
    ],
)
def test_a_recipe_with_a_reference_takes_it(name, kwargs):
    sync = get_recipe(name, policy_kwargs=kwargs).reference_sync
    assert sync == ReferenceSync(
        source="policy", target="reference", alpha=kwargs.get("ref_sync_alpha", 0.6), every=kwargs["ref_sync_steps"]
    )
    assert get_recipe(name, policy_kwargs={**kwargs, "ref_sync_steps": 0, "ref_sync_alpha": 0.6}).reference_sync is None


def test_the_roles_of_a_sync_are_checked_with_the_recipe():
    base = get_recipe("grpo", policy_kwargs={"kl_coef": 0.04})
    sync = ReferenceSync(source="policy", target="reference", alpha=0.5, every=1)
    with pytest.raises(ConfigError, match="the source must be a trainable role and the target a frozen one"):
        dataclasses.replace(base, reference_sync=dataclasses.replace(sync, source="reference", target="policy"))
    other = ModelRole(name="reference", specialization_cls=LogProbSpecialization, trainable=False, model_path="/other")
    with pytest.raises(ConfigError, match="the two roles load different checkpoints"):
        dataclasses.replace(base, roles=(base.roles[0], other), reference_sync=sync)
    with pytest.raises(ConfigError, match="alpha must be in"):
        ReferenceSync(source="policy", target="reference", alpha=0.0, every=1)


def test_the_cli_refuses_it_without_a_reference(tmp_path, capsys):
    assert areno_main(train_args(tmp_path, "train.algorithm_kwargs.ref_sync_steps=2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.algorithm_kwargs.ref_sync_steps=2 moves a frozen reference" in err[0], err


@pytest.mark.parametrize(
    "placement",
    [
        ["cluster.role_devices={reference: [1]}"],
        ["cluster.allocation_mode=areno:d1+fsdp:d1"],
    ],
)
def test_a_reference_outside_the_policy_process_is_refused(tmp_path, placement):
    overrides = [
        *tiny_run_overrides(tmp_path),
        f"{KEY[:-1]}={{kl_coef: 0.04, ref_sync_steps: 2}}",
        *placement,
    ]
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        check_reference_sync(config, resolve_recipe(config))
    assert "the reference moves toward the policy in place" in str(info.value) and "\n" not in str(info.value)


def _backends(recipe, policy_dir):
    backends = {}
    for role in recipe.roles:
        backend = LocalTrainBackend(
            TrainBackendConfig(
                lr=1e-2, trainable=role.trainable, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None
            )
        )
        backend.initialize(policy_dir)
        backends[role.name] = backend
    return backends


def _weights(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def _recording(backend, seen: list) -> None:
    """``backend``'s train_step appends its weights after each optimizer step to ``seen``."""
    train_step = backend.train_step

    def recording(*args, **kwargs):
        out = train_step(*args, **kwargs)
        seen.append(_weights(backend))
        return out

    backend.train_step = recording


@pytest.mark.parametrize("every", [1, 2, 3])
def test_the_reference_is_mixed_as_by_hand_every_n_optimizer_steps(tmp_path, every):
    """Three steps of grpo with its KL, two optimizer steps each (num_minibatches=2): after the policy's
    optimizer step s, where s % every == 0, ref = 0.25 policy + 0.75 ref; the reference is left alone
    otherwise."""
    policy_dir = tiny_policy_dir(tmp_path)
    recipe = get_recipe("grpo", policy_kwargs={"kl_coef": 0.1, "ref_sync_steps": every, "ref_sync_alpha": 0.25})
    backends = _backends(recipe, policy_dir)
    runner = RecipeRunner(recipe, backends, num_minibatches=2)
    expected = _weights(backends["reference"])
    initial = {n: t.clone() for n, t in expected.items()}
    seen: list[dict[str, torch.Tensor]] = []
    _recording(backends["policy"], seen)
    batch = rl_batch_for(policy_dir)
    for step in range(1, 4):
        metrics = runner.step(batch)
        assert metrics["reference/ref_syncs"] == (2 * step) // every
    assert len(seen) == 6
    for s, policy in enumerate(seen, start=1):
        if s % every == 0:
            expected = {n: 0.25 * policy[n] + 0.75 * expected[n] for n in expected}
    got = _weights(backends["reference"])
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6)
    assert not torch.equal(got["model.norm.weight"], initial["model.norm.weight"])


def test_without_it_the_reference_stays_the_initial_policy(tmp_path):
    policy_dir = tiny_policy_dir(tmp_path)
    recipe = get_recipe("grpo", policy_kwargs={"kl_coef": 0.1})
    backends = _backends(recipe, policy_dir)
    initial = _weights(backends["reference"])
    metrics = RecipeRunner(recipe, backends).step(rl_batch_for(policy_dir))
    assert "reference/ref_syncs" not in metrics
    assert all(torch.equal(t, initial[n]) for n, t in _weights(backends["reference"]).items())


def test_alpha_1_copies_the_policy_and_a_different_model_is_refused(tmp_path):
    policy_dir = tiny_policy_dir(tmp_path)
    recipe = get_recipe("grpo", policy_kwargs={"kl_coef": 0.1})
    backends = _backends(recipe, policy_dir)
    with torch.no_grad():
        for p in backends["policy"].model.parameters():
            p.add_(0.5)
    backends["reference"].mix_weights(backends["policy"].named_weights(), alpha=1.0)
    policy, ref = _weights(backends["policy"]), _weights(backends["reference"])
    assert all(torch.equal(policy[n], ref[n]) for n in policy)
    partial = [(n, t) for n, t in backends["policy"].named_weights() if n != "model.norm.weight"]
    with pytest.raises(ValueError, match="no tensor named 'model.norm.weight'"):
        backends["reference"].mix_weights(partial, alpha=0.5)


def _run(tmp_path, name: str, steps: int, *extra: str):
    return resumable_run(tmp_path, name, steps, "{kl_coef: 0.1, ref_sync_steps: 1, ref_sync_alpha: 0.5}", *extra)


def _reference_at(run_dir, step: int, policy_dir) -> dict[str, torch.Tensor]:
    model = load_model(policy_dir, dtype=torch.float32, device="cpu")[0]
    (path,) = [d for d in (run_dir / "checkpoints").glob("step_*") if int(d.name.removeprefix("step_")) == step]
    load_checkpoint(path / "reference", model, None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_resumed_run_has_the_uninterrupted_runs_reference(tmp_path):
    """4 steps at once against 2 steps then 2 more resumed from the step-2 checkpoint: the same losses, KL
    and reference weights at step 4 (the checkpoint holds the reference the syncs moved)."""
    whole = _run(tmp_path, "whole", 4)
    _run(tmp_path, "parts", 2)
    resumed = _run(tmp_path, "parts", 4)
    keys = ("train/policy/loss", "train/policy/actor/kl", "train/reference/ref_syncs")
    by_step = {int(r["step"]): r for r in whole if "train/policy/loss" in r}
    for row in (r for r in resumed if "train/policy/loss" in r):
        for key in keys:
            assert row[key] == by_step[int(row["step"])][key], (row["step"], key)
    assert [int(r["step"]) for r in resumed if "train/policy/loss" in r] == [1, 2, 3, 4]  # one metrics file
    model_dir = tmp_path / "model"
    a, b = _reference_at(tmp_path / "whole", 4, model_dir), _reference_at(tmp_path / "parts", 4, model_dir)
    initial = load_model(model_dir, dtype=torch.float32, device="cpu")[0].state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.norm.weight"], initial["model.norm.weight"])  # it moved


def test_resuming_a_checkpoint_without_the_reference_is_refused(tmp_path):
    """A checkpoint written without ref_sync_steps holds no reference: the resumed run cannot know where the
    syncs would have moved it, so it says so rather than start the reference from the initial policy."""
    overrides = [
        *tiny_run_overrides(tmp_path),
        "train.steps=2",
        "train.save_interval=2",
        "train.eval_interval=0",
        "reward.sandbox=false",
        "resume=auto",
        "train.algorithm_kwargs={kl_coef: 0.1}",
    ]
    run_to_end(load_config(None, overrides))
    later = [*overrides[:-1], "train.steps=3", "train.algorithm_kwargs={kl_coef: 0.1, ref_sync_steps: 1}"]
    with pytest.raises(
        ConfigError, match="holds no weights of role 'reference', which train.algorithm_kwargs.ref_sync"
    ):
        run_to_end(load_config(None, later))


def test_areno_recipes_lists_the_reference_sync_keys_where_a_reference_can_be(capsys):
    """``areno recipes NAME`` shows ``ref_sync_steps`` / ``ref_sync_alpha`` with their defaults and meanings for a
    recipe with a reference (ppo_kl), or one that gains it with kl_coef (grpo, said so), not for sft."""
    from areno.cli import main as areno_main

    for name, shown in (("ppo_kl", True), ("grpo", True), ("sft", False)):
        assert areno_main(["recipes", name]) == 0
        out = capsys.readouterr().out
        assert ("    ref_sync_steps=0\n" in out and "    ref_sync_alpha=0.6\n" in out) == shown, name
    assert areno_main(["recipes", "grpo"]) == 0
    assert "the reference role following the policy (with a reference: train.algorithm_kwargs.kl_coef > 0):" in (
        capsys.readouterr().out
    )


def test_a_lora_policy_moves_the_reference_toward_its_merged_weights(tmp_path):
    """With train.lora the policy's weights are the base plus its adapters: the reference moves toward that merged
    model (the names the rollout receives), never toward the bare base or an adapter tensor."""
    from areno.train import LoraConfig

    policy_dir = tiny_policy_dir(tmp_path)
    recipe = get_recipe("grpo", policy_kwargs={"kl_coef": 0.1, "ref_sync_steps": 1, "ref_sync_alpha": 1.0})
    backends = _backends(recipe, policy_dir)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    backends["policy"] = LocalTrainBackend(
        TrainBackendConfig(lr=5e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None, lora=lora)
    )
    backends["policy"].initialize(policy_dir)
    initial = _weights(backends["reference"])
    RecipeRunner(recipe, backends).step(rl_batch_for(policy_dir))
    merged = dict(backends["policy"].named_weights())
    got = _weights(backends["reference"])
    assert set(got) <= set(merged) and not any(".lora_" in n for n in merged)
    for n in got:  # alpha 1: the reference is the merged policy
        torch.testing.assert_close(got[n], merged[n], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], initial[q])  # the adapter's update reached it
    assert torch.equal(got["model.norm.weight"], initial["model.norm.weight"])  # LoRA leaves the norm as it was
