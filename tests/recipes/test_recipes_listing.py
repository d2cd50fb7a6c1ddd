"""``areno recipes`` lists what kind of run each recipe is, read off its roles: RUN (online: rollouts of
the policy; offline: dataset rows), STALE (what its loss does with rollouts of older policies) and EXTRA
ROLES (those beside the policy), for the shipped recipes and a user's alike, in 100 columns."""

from pathlib import Path

import pytest

from areno.recipes import TRAINING_CONFIGS, DataSync, ModelRole, TrainingConfig, main, recipe
from areno.recipes.registry import LISTING_WIDTH
from areno.recipes.traits import STALE_LABELS
from areno.specializations import ActorSpecialization, LogProbSpecialization


def _listed(capsys) -> tuple[dict[str, tuple[str, str, str]], list[str]]:
    """Name -> (RUN, STALE, EXTRA ROLES) of each row of ``areno recipes``, and its lines."""
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "RUN", "STALE", "EXTRA", "ROLES"]
    rows = {}
    for line in lines[1 : lines.index("")]:
        if line.startswith(" "):  # a description under its row
            continue
        name, run, stale, roles = line.split(maxsplit=3)
        rows[name] = (run, stale, roles)
    return rows, lines


@pytest.mark.parametrize(
    "name, run, stale, roles",
    [
        ("grpo", "online", "uncorrected", "-"),
        ("ppo", "online", "uncorrected", "value"),
        ("ppo_kl", "online", "uncorrected", "value, reference"),
        ("dpo", "offline", "-", "reference"),
        ("sft", "offline", "-", "-"),
        ("opd", "online", "uncorrected", "teacher"),
        ("grpo_async", "online", "corrected", "-"),
        ("ppo_async", "online", "corrected", "value"),
        ("grpo_recompute", "online", "recomputed", "-"),
        ("cispo", "online", "truncated-IS", "-"),
    ],
)
def test_shipped_recipes_are_listed_with_their_kind(capsys, name, run, stale, roles):
    rows, _ = _listed(capsys)
    assert rows[name] == (run, stale, roles)


def test_every_line_fits_100_columns_and_every_stale_value_is_explained(capsys):
    rows, lines = _listed(capsys)
    assert len(rows) == len(TRAINING_CONFIGS)
    assert max(len(line) for line in lines) <= LISTING_WIDTH
    legend = "\n".join(lines[lines.index("") :])
    assert {stale for _, stale, _ in rows.values()} <= set(STALE_LABELS)
    for label in STALE_LABELS:
        assert f"\n  {label} " in legend, label
    grpo = lines.index(next(line for line in lines if line.startswith("grpo ")))
    assert lines[grpo + 1].startswith("  GRPO: group-normalised advantages")  # the description beneath


def test_a_users_recipe_gets_the_same_columns(capsys, registry):
    @recipe("my_async_kl")
    def my_async_kl() -> TrainingConfig:
        """Decoupled PPO with a KL to a frozen reference."""
        policy = ModelRole(
            name="policy",
            specialization_cls=ActorSpecialization,
            sync_to_rollout=True,
            init_kwargs={"use_decoupled_loss": True, "kl_coef": 0.1},
        )
        reference = ModelRole(name="anchor", specialization_cls=LogProbSpecialization, trainable=False)
        sync = DataSync(source="anchor", target="policy", keys=("logprobs_T",), target_keys=("ref_logprobs_T",))
        return TrainingConfig(name="my_async_kl", roles=(policy, reference), syncs=(sync,))

    @recipe("my_needs_options")
    def my_needs_options(path: str) -> TrainingConfig:
        """A factory that cannot be built without an option of its own."""
        raise TypeError(path)

    @recipe("my_reads_its_teacher")
    def my_reads_its_teacher(teacher_path: str = "") -> TrainingConfig:
        """A factory that opens its path option (the listing builds it with a placeholder path)."""
        Path(teacher_path, "config.json").read_text()
        raise AssertionError("unreachable")

    rows, _ = _listed(capsys)
    assert rows["my_async_kl"] == ("online", "corrected", "anchor")
    assert rows["my_needs_options"] == ("?", "?", "?")
    assert rows["my_reads_its_teacher"] == ("?", "?", "?")


def test_a_long_role_list_wraps_under_its_column(capsys, registry):
    names = [f"frozen_scorer_number_{i}" for i in range(6)]

    @recipe("many_roles")
    def many_roles() -> TrainingConfig:
        """A policy beside many frozen roles."""
        policy = ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True)
        others = [ModelRole(name=n, specialization_cls=LogProbSpecialization, trainable=False) for n in names]
        return TrainingConfig(name="many_roles", roles=(policy, *others))

    _, lines = _listed(capsys)
    assert max(len(line) for line in lines) <= LISTING_WIDTH
    start = next(i for i, line in enumerate(lines) if line.startswith("many_roles "))
    column = lines[0].index("EXTRA ROLES")
    assert lines[start][column:].startswith("frozen_scorer_number_0, ")
    assert lines[start + 1][:column].strip() == "" and lines[start + 1][column:].startswith("frozen_scorer_number_")
