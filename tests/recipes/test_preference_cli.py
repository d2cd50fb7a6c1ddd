"""Preference recipes (dpo, dpo_distributed, reward_model) trained from a file of TRL preference rows:
each row two sequences of one group, rendered as SFT renders its data; malformed rows refused at
preflight naming file, line and field; DPO's first steps against a loss computed by hand with the
reference = the starting model; a reward model's pair accuracy rising, its export read back by
transformers; held-out pairs scored without generating, by a run that builds no rollout side and
resumes from its checkpoints (older ones, which stored a rollout sampler's state, too); the docs'
command run as written."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.cli import main
from areno.data.datasets import build_splits
from areno.data.prompts import render_prompt
from areno.data.tasks import PromptStream
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.api import load_tokenizer, preference_trajectories
from areno.errors import ConfigError, DataError
from areno.models.hf_io import load_model, read_score_head
from areno.observe.metrics import read_metrics
from areno.specializations import preference_pairs
from areno.train import checkpoint
from areno.types import TokenBatch

torch.set_num_threads(1)

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
TINY = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"
PAIRS = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": "2+2=", "chosen": "4", "rejected": "22"},
    {"prompt": "3+4=", "chosen": "7", "rejected": "1"},
    {"prompt": "5+1=", "chosen": "6", "rejected": "51"},
    {"prompt": "0+8=", "chosen": "8", "rejected": "9"},
    {"prompt": "6+3=", "chosen": "9", "rejected": "63"},
]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _overrides(tmp_path: Path, algorithm: str, train: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        TINY,
        f"train.algorithm={algorithm}",
        "data.task=null",
        f"data.train_path={train}",
        "rollout.batch_size=3",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "train.seed=3",
        *extra,
    ]


# ------------------------------------------------------------------------------ rows -> pairs
def test_a_row_becomes_its_chosen_then_its_rejected_sequence_of_one_group():
    tok = build_char_tokenizer()
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "45"},
        {  # TRL's conversational completions: the assistant messages' contents, one after another
            "prompt": "9-1=",
            "chosen": [{"role": "assistant", "content": "8"}],
            "rejected": [{"role": "assistant", "content": "1"}, {"role": "assistant", "content": "0"}],
        },
    ]
    trajs = preference_trajectories(rows, tok, "prompt")
    assert len(trajs) == 4
    expected = [("1+2=", "3", 1.0), ("1+2=", "45", 0.0), ("9-1=", "8", 1.0), ("9-1=", "10", 0.0)]
    for t, (prompt, text, reward) in zip(trajs, expected):
        assert t.prompt_ids == render_prompt(tok, prompt) == tok.encode(prompt)  # the char tokenizer: raw prompts
        assert t.completion_ids == tok.encode(text) + [tok.eos_token_id]
        assert t.reward == reward and t.logprobs == [0.0] * len(t.completion_ids)
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id == trajs[3].group_id
    chosen_P, rejected_P = preference_pairs(TokenBatch.from_trajectories(trajs))
    assert chosen_P.tolist() == [0, 2] and rejected_P.tolist() == [1, 3]
    # a row drawn twice into one batch makes two pairs, not a group of four
    twice = TokenBatch.from_trajectories(preference_trajectories([rows[0], rows[0]], tok, "prompt"))
    assert [len(p) for p in preference_pairs(twice)] == [2, 2]


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [PAIRS[0], "", {"prompt": "a", "chosen": "x"}],
            "line 3: no field 'rejected': the dispreferred completion, which preference recipes (dpo, reward_model) "
            "train on (fields are 'prompt', 'chosen'; a row is TRL's {prompt, chosen, rejected})",
        ),
        (
            [{"prompt": "a", "rejected": "x"}],
            "line 1: no field 'chosen': the preferred completion",
        ),
        (
            [{"prompt": "a", "chosen": "x", "rejected": ""}],
            "line 1: 'rejected' is empty: a pair needs two non-empty completions; fill it in or remove the row",
        ),
        (
            [PAIRS[0], {"prompt": "a", "chosen": 5, "rejected": "y"}],
            "line 2: 'chosen' is a number, not a string or a list of assistant messages: give the preferred completion",
        ),
        (
            [{"prompt": "a", "chosen": "x", "rejected": None}],
            "line 1: 'rejected' is null, not a string or a list of assistant messages",
        ),
        (
            [{"prompt": "a", "chosen": [{"role": "user", "content": "x"}], "rejected": "y"}],
            "line 1: 'chosen' is a message list but a message is not the assistant's",
        ),
        (
            [{"prompt": "a", "chosen": [{"role": "assistant", "content": ""}], "rejected": "y"}],
            "line 1: 'chosen' is empty",
        ),
        (
            [{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], "rejected": []}],
            "line 1: no field 'prompt': TRL's implicit-prompt preference rows",
        ),
    ],
)
@pytest.mark.parametrize("algorithm", ["dpo", "reward_model"])
def test_malformed_preference_rows_are_one_line_at_preflight(tmp_path, rows, message, algorithm):
    bad = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        check_run(load_config(None, _overrides(tmp_path, algorithm, bad)))
    assert str(err.value).startswith(f"{bad} {message}")
    assert "\n" not in str(err.value)
    # the held-out file is checked alike
    good = _write(tmp_path / "good.jsonl", PAIRS)
    with pytest.raises(DataError, match=re.escape(f"{bad} line")):
        check_run(load_config(None, _overrides(tmp_path, algorithm, good, f"data.eval_path={bad}")))
    assert not (tmp_path / "model").exists()  # refused before a model is made


def test_what_a_preference_recipe_cannot_do_is_refused_in_one_line(tmp_path):
    good = _write(tmp_path / "good.jsonl", PAIRS)
    cases = [
        (
            ["data.task=arithmetic", "data.train_path=null"],
            "data.task='arithmetic' makes prompt/answer rows, but the recipe (train.algorithm) trains on preference "
            "pairs: set data.task=null and data.train_path to a file of {prompt, chosen, rejected} rows",
        ),
        (  # zeros would be a silent, wrong reference
            ["train.algorithm_kwargs={ref_key: logprobs_T}"],
            "recipe 'dpo': role 'policy' reads its reference log-probs from the data (ref_key='logprobs_T'), but "
            "preference rows record none",
        ),
        (
            ["train.eval_samples=4"],
            "train.eval_samples: train.algorithm=dpo evaluates held-out preference pairs by the model's scores and "
            "generates nothing: the setting does nothing here: drop it",
        ),
        (  # each role would cut a long completion to its own budget: the reference's sum could differ
            ["train.long_sequences=truncate"],
            "train.long_sequences=truncate: train.algorithm=dpo compares whole completions",
        ),
        (  # no rollout engine is built for a run that never generates (engine.api.generates)
            ["rollout.max_new_tokens=64"],
            "rollout.max_new_tokens: train.algorithm=dpo trains offline on the dataset's rows (rollout.batch_size a "
            "step) and generates nothing in this run (no held-out evaluation that samples), so it builds no "
            "rollout engine: the setting does nothing here: drop it",
        ),
        (
            ["rollout.backend=vllm"],
            "rollout.backend: train.algorithm=dpo trains offline",
        ),
        (
            [f"data.eval_path={good}", "test_rollout.enabled=true"],
            "test_rollout.enabled: the test rollout generates completions of held-out prompts, but "
            "train.algorithm=dpo learns from preference pairs",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as err:
            check_run(load_config(None, _overrides(tmp_path, "dpo", good, *extra)))
        assert str(err.value).startswith(message), str(err.value)
    # an sft file is no preference file, and a preference file no sft file
    with pytest.raises(DataError, match="line 1: no field 'chosen'"):
        check_run(
            load_config(
                None, _overrides(tmp_path, "dpo", _write(tmp_path / "sft.jsonl", [{"prompt": "a", "answer": "b"}]))
            )
        )
    with pytest.raises(DataError, match="line 1: no field 'answer'"):
        check_run(load_config(None, _overrides(tmp_path, "sft", good)))
    # sft samples for its held-out rows only: without them its engine settings do nothing either
    qa = _write(tmp_path / "qa.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(ConfigError, match=r"^rollout.block_size: train.algorithm=sft .* generates nothing"):
        check_run(load_config(None, _overrides(tmp_path, "sft", qa, "data.num_eval=0", "rollout.block_size=8")))
    check_run(load_config(None, _overrides(tmp_path, "sft", qa, f"data.eval_path={qa}", "rollout.block_size=8")))


# ------------------------------------------------------------------------------ no rollout side
BATCH_KEYS = {"rollout/num_seqs", "rollout/num_tokens", "rollout/epoch"}
"""The only ``rollout/*`` keys of an offline run: its data batch's size and the epochs drawn (docs/metrics.md)."""


def _no_rollout_run(cfg) -> list[dict]:
    """Run ``cfg`` to its end, checking the engine built no rollout side; the run's metric rows."""
    trainer = Trainer.init(cfg)
    try:
        assert trainer.backend.engine.rollout is None
        trainer.run()
    finally:
        trainer.shutdown()
    return read_metrics(Path(cfg.run_dir))


def _as_if_written_with_a_rollout_side(step_dir: Path) -> None:
    """Give a checkpoint the rollout sampler's state that runs stored before they built no rollout side."""
    for state_file in step_dir.glob("*/trainer_state.pt"):
        state = torch.load(state_file, weights_only=True)
        state["extra"]["rollout_rng"] = torch.Generator().get_state()
        torch.save(state, state_file)
    checkpoint.write_manifest(step_dir)
    assert checkpoint.verify(step_dir) is None


@pytest.mark.parametrize(("algorithm", "role"), [("dpo", "policy"), ("reward_model", "reward")])
def test_a_preference_run_builds_no_rollout_side_and_resumes_from_its_checkpoints(tmp_path, algorithm, role):
    train = _write(tmp_path / "prefs.jsonl", PAIRS)

    def config(run: str, steps: int, *extra: str):
        overrides = _overrides(tmp_path, algorithm, train, f"data.eval_path={train}", "optim.lr=0.05", *extra)
        every = ["train.eval_interval=2", "train.save_interval=1"]
        return load_config(None, [*overrides, f"run_dir={tmp_path / run}", f"train.steps={steps}", *every])

    whole = _no_rollout_run(config("whole", 4))
    _no_rollout_run(config("part", 2))
    _no_rollout_run(config("part", 3, "resume=true"))  # from step 2's checkpoint, as this run wrote it
    step_3 = tmp_path / "part" / "checkpoints" / "step_00000003"
    assert "rollout_rng" not in torch.load(step_3 / role / "trainer_state.pt", weights_only=True)["extra"]
    _as_if_written_with_a_rollout_side(step_3)
    resumed = _no_rollout_run(config("part", 4, "resume=true"))

    loss = f"train/{role}/loss"
    losses = [r[loss] for r in whole if loss in r]
    assert len(losses) == 4 and losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference / zero head
    assert losses[1] != pytest.approx(math.log(2), abs=1e-5)  # it trained
    assert [r[loss] for r in resumed if loss in r] == losses  # resumed twice, the same steps
    # held-out pairs scored on the training side: after step 2 (train.eval_interval) and each run's last step
    evals = lambda rows: {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert sorted(evals(whole)) == [2, 4] and sorted(evals(resumed)) == [2, 3, 4]
    assert evals(resumed)[2] == evals(whole)[2] and evals(resumed)[4] == evals(whole)[4]
    # no rollout engine, no sync: the batch's size is the only rollout/* figure, no policy_sync_* key
    for row in whole + resumed:
        assert {k for k in row if k.startswith("rollout/")} <= BATCH_KEYS, row
        assert not [k for k in row if k.startswith(("policy_sync", "system/rollout", "system/sync"))], row
    if algorithm == "dpo":  # areno eval generates with the exported policy on its own rollout engine
        qa = _write(tmp_path / "qa.jsonl", [{"prompt": r["prompt"], "answer": r["chosen"]} for r in PAIRS[:2]])
        args = ["eval", str(tmp_path / "part" / "config.yaml"), "--checkpoint", "latest"]
        assert main([*args, f"data.train_path={qa}", f"data.eval_path={qa}", "rollout.max_new_tokens=2"]) == 0


# ------------------------------------------------------------------------------ DPO numerics
@torch.no_grad()
def _completion_logprob(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """log pi(completion | prompt): one unpacked fp32 forward, summed over the completion's tokens."""
    ids = torch.tensor(prompt_ids + completion_ids)
    logp = torch.log_softmax(model.logits(model(ids, torch.arange(ids.numel()))).double(), -1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(len(prompt_ids), ids.numel()))


def _dpo_by_hand(policy, reference, tok, rows, beta) -> tuple[float, float]:
    """(mean DPO loss, fraction of pairs with a positive implicit-reward margin) of ``rows``."""
    losses, right = [], 0
    for row in rows:
        p = tok.encode(row["prompt"])
        c, r = (tok.encode(row[k]) + [tok.eos_token_id] for k in ("chosen", "rejected"))
        h = beta * (
            (_completion_logprob(policy, p, c) - _completion_logprob(reference, p, c))
            - (_completion_logprob(policy, p, r) - _completion_logprob(reference, p, r))
        )
        losses.append(math.log1p(math.exp(-h)))  # -log sigmoid(h)
        right += h > 0
    return sum(losses) / len(losses), right / len(rows)


def _evaluated_then_run(cfg) -> dict[str, float]:
    """The held-out figures of the starting model, then the whole run."""
    trainer = Trainer.init(cfg)
    try:
        before = trainer.evaluate_now()
        trainer.run()
    finally:
        trainer.shutdown()
    return before


@pytest.mark.slow
def test_dpo_steps_match_a_hand_computed_loss_with_the_starting_model_as_reference(tmp_path):
    train = _write(tmp_path / "prefs.jsonl", PAIRS)
    beta = 0.5
    cfg = load_config(
        None,
        _overrides(
            tmp_path,
            "dpo",
            train,
            f"data.eval_path={train}",
            f"train.algorithm_kwargs={{beta: {beta}}}",
            "train.steps=2",
            "train.eval_interval=1",
            "train.save_interval=1",
            "optim.lr=0.05",
        ),
    )
    before = _evaluated_then_run(cfg)
    rows = read_metrics(tmp_path / "run")
    losses = [r["train/policy/loss"] for r in rows if "train/policy/loss" in r]
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    # step 1: policy = reference, every implicit reward 0: -log sigmoid(0) = log 2; held out alike
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert before["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["eval/accuracy"] == 0.0 and before["eval/num_pairs"] == len(PAIRS)  # a tie is no preference
    # step 2: the policy after one update (its export) against the starting model, on step 2's rows
    tok = load_tokenizer(tmp_path / "model")
    reference, _ = load_model(tmp_path / "model")
    after_one, _ = load_model(tmp_path / "run" / "checkpoints" / "step_00000001" / "hf")
    stream = PromptStream(build_splits(cfg.data, pairs=True)[0], seed=cfg.data.seed)
    stream.take(3)
    expected, _ = _dpo_by_hand(after_one, reference, tok, stream.take(3), beta)
    assert expected != pytest.approx(math.log(2), abs=1e-3)  # the policy did move
    assert losses[1] == pytest.approx(expected, rel=1e-4)
    # the held-out figures after each step: the same computation on every pair
    assert sorted(evals) == [0, 1, 2]
    for step in (1, 2):
        policy, _ = load_model(tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "hf")
        loss, accuracy = _dpo_by_hand(policy, reference, tok, PAIRS, beta)
        assert evals[step]["eval/loss"] == pytest.approx(loss, rel=1e-4)
        assert evals[step]["eval/accuracy"] == accuracy


# ------------------------------------------------------------------------------ reward model
@pytest.mark.slow
def test_a_reward_model_learns_an_easy_preference_and_exports_a_sequence_classifier(tmp_path):
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    digits = "0123456789"
    rows = []
    for _ in range(12):  # chosen: always "ok"; rejected: two random digits
        a, b, x, y = (digits[int(i)] for i in torch.randint(0, 10, (4,), generator=gen))
        rows.append({"prompt": f"{a}+{b}=", "chosen": "ok", "rejected": f"{x}{y}"})
    train = _write(tmp_path / "prefs.jsonl", rows)
    cfg = load_config(
        None,
        _overrides(
            tmp_path,
            "reward_model",
            train,
            f"data.eval_path={train}",  # accuracy on the training pairs
            "rollout.batch_size=4",
            "train.steps=6",
            "train.eval_interval=2",
            "train.save_interval=6",
            "optim.lr=0.01",
        ),
    )
    before = _evaluated_then_run(cfg)
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    # a zero-initialised head scores every sequence 0: all ties, loss log 2
    assert before["eval/accuracy"] == 0.0 and before["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["eval/accuracy"] == 1.0
    assert evals[-1]["eval/loss"] < evals[1]["eval/loss"] < math.log(2)
    train_acc = [
        r["train/reward/reward_model/accuracy"] for r in read_metrics(tmp_path / "run") if "train/reward/loss" in r
    ]
    assert train_acc[0] == 0.0 and train_acc[-1] == 1.0
    # the export: transformers' sequence classifier, whose pooled score (last token) gives the same pairs
    hf = tmp_path / "run" / "checkpoints" / "step_00000006" / "hf"
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert read_score_head(hf)["score.weight"].shape == (1, 32) and "score.bias" not in read_score_head(hf)
    load_model(hf)  # areno reads it too (its scorer role: aggrevate q_source=reward_model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf).eval()
    tok = load_tokenizer(hf)
    losses, right = [], 0
    with torch.no_grad():
        for row in rows:
            s = [
                float(model(torch.tensor([tok.encode(row["prompt"]) + tok.encode(row[k]) + [tok.eos_token_id]])).logits)
                for k in ("chosen", "rejected")
            ]
            losses.append(math.log1p(math.exp(-(s[0] - s[1]))))
            right += s[0] > s[1]
    assert right / len(rows) == evals[-1]["eval/accuracy"] == 1.0
    assert sum(losses) / len(losses) == pytest.approx(evals[-1]["eval/loss"], rel=1e-4)
    # areno eval does not generate with a reward model
    args = ["eval", f"{tmp_path / 'run' / 'config.yaml'}", "--checkpoint", "latest"]
    assert main(args) == 2


# ------------------------------------------------------------------------------ the docs' command
def _doc_section() -> str:
    text = DOC.read_text()
    return text[text.index("## Preference data") :]


def test_the_docs_preference_command_trains_two_steps(tmp_path, monkeypatch, capsys):
    section = _doc_section()
    (block,) = re.findall(r"```jsonl\n(.*?)```", section, flags=re.S)
    command = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].replace("\\\n", " ").strip()
    monkeypatch.chdir(tmp_path)
    Path("prefs.jsonl").write_text(block)
    args = shlex.split(command)
    assert args[:2] == ["areno", "train"] and "--algorithm" in args
    assert main([*args[1:], "observe.console=false", "cluster.cpu_threads=1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run_dir = Path(summary["run_dir"])
    losses = [r["train/policy/loss"] for r in read_metrics(run_dir) if "train/policy/loss" in r]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert summary["accuracy_before"] == 0.0 and summary["accuracy_after"] is not None
