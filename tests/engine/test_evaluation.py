"""``areno eval`` (``areno.engine.evaluation``): a greedy evaluation of checkpoint k gives the accuracy
the run's test rollout logged for it; sampled evaluations are reproducible by seed; pass@k is the
unbiased estimate; the rows file holds every completion; a wrong option or path is one line."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.cli import main
from areno.data.datasets import build_splits
from areno.engine.evaluation import EvalOptions, eval_rows, resolve_checkpoint, run_eval
from areno.engine.scoring import eval_metrics, pass_at_k, pass_ks
from areno.errors import ConfigError, DataError, ModelDirError
from areno.types import Trajectory
from tests.helpers.configs import run_to_end, tiny_run_overrides

REWARD = "tests.helpers.rewards:first_char"  # in [0, 1), varies with the completion


def _overrides(root: Path, *extra: str) -> list[str]:
    return [*tiny_run_overrides(root, num_eval=6, reward=REWARD), "reward.sandbox=false", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run whose test rollout scored the checkpoints of steps 1-3 (``test/accuracy``)."""
    root = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        None,
        _overrides(
            root, "train.steps=3", "optim.lr=0.05", "train.eval_interval=0", "test_rollout.enabled=true",
            "test_rollout.interval=1",
        ),
    )  # fmt: skip
    rows = run_to_end(cfg)
    return root, cfg, {int(r["test/step"]): r["test/accuracy"] for r in rows if "test/accuracy" in r}


def test_greedy_eval_of_each_checkpoint_equals_the_accuracy_its_run_logged(trained):
    root, cfg, logged = trained
    assert 3 in logged  # the test rollout skips to the newest checkpoint when it falls behind
    for step, accuracy in logged.items():
        summary = run_eval(cfg, EvalOptions(checkpoint=str(root / "run" / "checkpoints" / f"step_{step:08d}")))
        assert summary["metrics"]["eval/accuracy"] == pytest.approx(accuracy, abs=1e-12), step
        assert summary["samples"] == 1
        assert summary["metrics"]["eval/num_prompts"] == 6
        assert summary["temperature"] == 0.0
    # 'latest', the run directory, the checkpoint's hf/ export and its step of the config's run all name step 3
    step3 = root / "run" / "checkpoints" / "step_00000003"
    for spec in ("latest", str(root / "run"), str(step3 / "hf"), "step_3", "3", "step_00000003"):
        path, name = resolve_checkpoint(spec, cfg)
        assert (path, name) == (root / "run" / "checkpoints" / "step_00000003" / "hf", "step_00000003"), spec
    base = run_eval(cfg, EvalOptions())  # model.path: the model before training
    assert base["model"] == str(root / "model")
    assert base["metrics"]["eval/accuracy"] != pytest.approx(logged[3])
    assert Path(base["rows_file"]) == root / "run" / "eval" / "base.jsonl"


def test_a_run_with_sampled_evaluations_logs_pass_at_k_and_areno_eval_repeats_them(tmp_path):
    """train.eval_samples=3: each evaluation of the run logs the mean reward of 3 seeded samples a
    row and pass@1, 2, 3; evaluating step k's checkpoint alone gives the same figures."""
    cfg = load_config(
        None,
        _overrides(
            tmp_path, "train.steps=2", "optim.lr=0.05", "train.eval_interval=1", "train.save_interval=1",
            "train.eval_samples=3", "train.eval_temperature=1.0", f"train.eval_pass_threshold={3 / 7}",
        ),
    )  # fmt: skip
    logged = {r["step"]: r for r in run_to_end(cfg) if "eval/accuracy" in r}
    assert sorted(logged) == [1, 2]
    keys = ["eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@3", "eval/reward_errors"]
    assert logged[1]["eval/samples_per_prompt"] == 3 and logged[1]["eval/num_prompts"] == 6
    assert logged[1]["eval/pass@1"] <= logged[1]["eval/pass@2"] <= logged[1]["eval/pass@3"]
    for step in (1, 2):
        alone = run_eval(cfg, EvalOptions(checkpoint=str(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")))
        assert alone["samples"] == 3 and alone["temperature"] == 1.0 and alone["pass_threshold"] == 3 / 7
        assert {k: alone["metrics"][k] for k in keys} == pytest.approx({k: logged[step][k] for k in keys}), step


def test_sampled_eval_is_reproducible_by_seed_and_its_rows_file_holds_every_sample(trained, tmp_path):
    root, cfg, _ = trained
    out = tmp_path / "rows.jsonl"
    options = dict(checkpoint="latest", samples=3, temperature=1.0, pass_threshold=3 / 7, seed=11)
    first = run_eval(cfg, EvalOptions(**options, out=str(out)))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["completions"]) == len(r["rewards"]) == 3 for r in rows)
    assert {r["prompt"] for r in rows} == {r["prompt"] for r in _held_out(cfg)}
    again = run_eval(cfg, EvalOptions(**options, out=str(tmp_path / "again.jsonl")))
    assert [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()] == rows
    other = run_eval(cfg, EvalOptions(**{**options, "seed": 12}, out=str(tmp_path / "other.jsonl")))
    assert (tmp_path / "other.jsonl").read_text() != out.read_text()
    assert first["metrics"] == pytest.approx({**again["metrics"], **_timings(first)})
    assert other["temperature"] == 1.0
    # the summary's figures, recomputed from the rows file with binomials
    m = first["metrics"]
    rewards = [r["rewards"] for r in rows]
    assert m["eval/accuracy"] == pytest.approx(sum(map(sum, rewards)) / 18)
    solved = [sum(x >= 3 / 7 for x in rs) for rs in rewards]
    for k in (1, 2, 3):
        by_hand = sum(1 - math.comb(3 - c, k) / math.comb(3, k) for c in solved) / 6
        assert m[f"eval/pass@{k}"] == pytest.approx(by_hand), k
    assert json.loads((tmp_path / "rows.summary.json").read_text()) == json.loads(json.dumps(first))
    # without --out, sampled evaluations of one checkpoint under other settings keep their own files
    named = run_eval(cfg, EvalOptions(checkpoint="latest", samples=2, temperature=0.5, split="train", num_prompts=2))
    assert Path(named["rows_file"]).name == "step_00000003-train-p2-n2-t0.5.jsonl"
    seeded = EvalOptions(checkpoint="latest", samples=2, temperature=0.5, num_prompts=2, seed=4)
    assert Path(run_eval(cfg, seeded)["rows_file"]).name == "step_00000003-p2-n2-t0.5-s4.jsonl"
    with pytest.raises(
        ModelDirError, match=r"step_00000009 is not a directory: .*complete checkpoints: .*step_00000003"
    ):
        resolve_checkpoint("step_9", cfg)
    # another run's checkpoint is named after its run, not written over this run's step_3 file
    elsewhere = dataclasses.replace(cfg, run_dir=str(tmp_path / "other"))
    assert resolve_checkpoint("step_3", cfg)[1] == "step_00000003"
    assert resolve_checkpoint(str(root / "run" / "checkpoints" / "step_00000003"), elsewhere)[1] == "run-step_00000003"


def test_num_prompts_scores_more_rows_than_num_eval_when_there_are_more(trained, tmp_path):
    """--num-prompts N scores N rows whatever data.num_eval (the rows the run scores), and the rows
    file is named after the rows scored; more rows than there are is refused before any model loads."""
    root, task_cfg, _ = trained
    more = eval_rows(task_cfg, "eval", 9)  # a task makes as many held-out rows as asked (num_eval=6)
    assert len(more) == 9 and more[:6] == eval_rows(task_cfg, "eval", 0)  # the run's own rows first
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    for name in ("train.jsonl", "held.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = [f"data.train_path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'held.jsonl'}"]
    cfg = load_config(None, [*_overrides(root), "data.task=null", *files, "data.num_eval=4"])
    summary = run_eval(cfg, EvalOptions(checkpoint="latest", num_prompts=7))
    assert summary["metrics"]["eval/num_prompts"] == 7
    assert Path(summary["rows_file"]).name == "step_00000003-p7.jsonl"
    scored = [json.loads(line)["prompt"] for line in Path(summary["rows_file"]).read_text().splitlines()]
    assert scored == [r["prompt"] for r in rows[:7]]
    assert len(eval_rows(cfg, "eval", 0)) == 4  # by default, the run's own held-out rows
    with pytest.raises(ConfigError, match=r"--num-prompts 11: .*held.jsonl has only 10 eval rows: pass at most 10"):
        run_eval(cfg, EvalOptions(checkpoint=str(tmp_path / "no-model"), num_prompts=11))


def _held_out(cfg):
    return build_splits(cfg.data)[1]


def _timings(summary: dict) -> dict:
    return {k: v for k, v in summary["metrics"].items() if k in ("eval/load_s", "eval/time_s") or k.endswith("_per_s")}


def test_pass_at_k_against_hand_computed_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand():
    def traj(reward, n_tokens, finish="stop", error=None):
        info = {"finish_reason": finish, **({"reward_error": error} if error else {})}
        return Trajectory(prompt_ids=[1], completion_ids=[2] * n_tokens, logprobs=[0.0] * n_tokens,
                          versions=[0] * n_tokens, reward=reward, info=info)  # fmt: skip

    rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]]
    trajectories = [
        [traj(1.0, 2), traj(0.0, 4, "length"), traj(0.5, 2), traj(1.0, 2)],
        [traj(0.0, 2, error="ValueError: x"), traj(0.0, 2), traj(0.0, 2), traj(0.0, 4, "length")],
    ]
    m = eval_metrics(rewards, trajectories, threshold=1.0)
    assert m["eval/accuracy"] == pytest.approx(2.5 / 8)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0) / 2)  # 0.5 does not reach the threshold
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2)
    assert m["eval/pass@4"] == pytest.approx(0.5)
    assert m["eval/reward_errors"] == 1
    assert m["eval/completion_tokens_mean"] == pytest.approx(20 / 8)
    assert m["eval/truncated_fraction"] == pytest.approx(2 / 8)
    assert eval_metrics(rewards, trajectories, threshold=0.5)["eval/pass@1"] == pytest.approx(3 / 8)


def test_a_raising_reward_scores_zero_and_is_recorded_per_sample(trained, tmp_path):
    root, _, _ = trained
    cfg = load_config(None, [*_overrides(root), "reward.fn=tests.helpers.rewards:exploding"])
    summary = run_eval(cfg, EvalOptions(checkpoint="latest", out=str(tmp_path / "rows.jsonl")))
    assert summary["metrics"]["eval/reward_errors"] == 6 and summary["metrics"]["eval/accuracy"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(r["reward_errors"] == ["RuntimeError: reward bug"] for r in rows)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"samples": 0}, "--samples: must be >= 1"),
        ({"temperature": -1.0}, "--temperature: must be 0 \\(greedy\\) or a finite number >= 0.001"),
        ({"temperature": 1e-38}, "--temperature: must be 0 \\(greedy\\) or a finite number >= 0.001"),
        ({"split": "test"}, "--split: must be one of eval, train"),
        ({"num_prompts": -1}, "--num-prompts: must be >= 0"),
        ({"pass_threshold": math.nan}, "--pass-threshold: must be a finite number"),
    ],
)
def test_wrong_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        EvalOptions(**options)


def test_wrong_checkpoints_and_rows_are_one_line_errors_before_any_model_loads(tmp_path, capsys):
    cfg = load_config(None, _overrides(tmp_path))
    with pytest.raises(ModelDirError, match="is not a directory"):
        resolve_checkpoint(str(tmp_path / "nowhere"), cfg)
    with pytest.raises(ModelDirError, match=r"checkpoints/step_00000007 is not a directory: .* such as step_120"):
        resolve_checkpoint("step_7", cfg)
    with pytest.raises(ModelDirError, match="no complete checkpoints"):
        resolve_checkpoint("latest", dataclasses.replace(cfg, run_dir=str(tmp_path)))
    half = tmp_path / "run" / "checkpoints" / "step_00000002"
    (half / "hf").mkdir(parents=True)
    (half / "hf" / "config.json").write_text("{}")
    for spec in (half, half / "hf"):
        with pytest.raises(ModelDirError, match="incomplete \\(no COMPLETE marker\\)"):
            resolve_checkpoint(str(spec), cfg)
    no_rows = load_config(None, [*_overrides(tmp_path), "data.num_eval=0"])
    with pytest.raises(DataError, match="no held-out rows.*--split train"):
        run_eval(no_rows, EvalOptions())
    served = load_config(None, [*_overrides(tmp_path), "rollout.backend=vllm", "rollout.servers=[http://x:1]"])
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="rollout.servers are servers you run"):
        run_eval(served, EvalOptions(checkpoint=str(tmp_path / "m")))
    for options, message in [
        ({"seed": 5}, "--seed: a greedy evaluation draws nothing"),
        ({"samples": 2, "temperature": 1.0, "seed": 2**53 - 3}, "--seed: seeds .* leave the sampler's exact range"),
        ({"out": "/proc/no/such/rows.jsonl"}, "--out: cannot write /proc/no/such/rows.jsonl"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run_eval(cfg, EvalOptions(**options))
    assert not (tmp_path / "model").exists()  # all refused before the model was made
    with pytest.raises(ConfigError, match="train.eval_temperature: must be 0 \\(greedy\\), >= 0.001 or null"):
        load_config(None, [*_overrides(tmp_path), "train.eval_temperature=1e-38"])
    # the command: exit code 2 and one line
    assert main(["eval", *_overrides(tmp_path), "--samples", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["areno: error: --samples: must be >= 1, got 0"]
    # a task's prompt longer than the context: found only when generating it
    long = load_config(None, [*_overrides(tmp_path), "rollout.max_model_len=4"])  # the task's prompts are longer
    with pytest.raises(DataError, match=r"the held-out row with prompt '.*': prompt has \d+ tokens but the context"):
        run_eval(long, EvalOptions(num_prompts=1))


def test_the_command_prints_its_summary_and_writes_the_rows(trained, tmp_path, capsys):
    root, _, logged = trained
    out = tmp_path / "step3.jsonl"
    code = main(["eval", *_overrides(root), "--checkpoint", "latest", "--num-prompts", "4", "--out", str(out)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["metrics"]["eval/num_prompts"] == 4
    assert summary["rows_file"] == str(out) and len(out.read_text().splitlines()) == 4


def test_the_first_failing_row_cancels_the_others_and_collects_their_errors():
    """A dead rollout server failed every row's request: the first error ended the evaluation while the
    other rows ran on, each logging "Task exception was never retrieved" (walk36's replica test)."""
    import asyncio

    from areno.data.tokenizer import build_char_tokenizer
    from areno.engine.scoring import ascore_rows
    from areno.types import SamplingParams

    class DeadServer(RuntimeError):
        pass

    started, cancelled = [], []

    class Client:
        async def agenerate(self, prompt_ids, params, **kwargs):
            started.append(1)
            if len(started) == 1:
                await asyncio.sleep(0)
                raise DeadServer("rollout server 0 is gone")
            try:
                await asyncio.sleep(0.05)
                raise DeadServer("rollout server 0 is gone")  # the rows still running fail as well
            except asyncio.CancelledError:
                cancelled.append(1)
                raise

    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        cfg = load_config(None, ["model.path=/m"])
        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
        with pytest.raises(DeadServer):
            await ascore_rows(Client(), build_char_tokenizer(), lambda *a, **k: 0.0, rows, cfg, SamplingParams())
        await asyncio.sleep(0.2)  # the others would have failed by now

    asyncio.run(main())
    import gc

    gc.collect()
    assert len(started) == 6 and len(cancelled) == 5 and not unretrieved


@pytest.mark.parametrize("samples, temperature", [(1, None), (4, 0.7)])
def test_an_evaluation_asks_the_engine_for_no_text_and_decodes_each_completion_once(samples, temperature):
    """The engine decoded every held-out completion on its step thread and ``ascore_row`` decoded it again
    (walk37: ~1 ms a 4,096-token completion at a 151k vocabulary, twice)."""
    import asyncio

    from areno.data.tokenizer import build_char_tokenizer
    from areno.engine.scoring import ascore_rows, eval_params
    from areno.types import GenerationOutput

    tokenizer = build_char_tokenizer()
    cfg = load_config(None, ["model.path=/m"])
    params = eval_params(cfg, samples, temperature, name="train.eval_samples")
    assert params.detokenize is False
    seen, decoded = [], []

    class Client:
        async def agenerate(self, prompt_ids, params, **kwargs):
            seen.append(params.detokenize)
            ids = tokenizer.encode("42", add_special_tokens=False)
            return GenerationOutput(
                request_id="r",
                prompt_ids=list(prompt_ids),
                output_ids=ids,
                output_logprobs=[0.0] * len(ids),
                output_versions=[0] * len(ids),
                finish_reason="stop",
            )

    def decode(ids, **kwargs):
        decoded.append(list(ids))
        return type(tokenizer).decode(tokenizer, ids, **kwargs)

    tokenizer.decode = decode
    rows = [{"prompt": f"{i}+1=", "answer": "42"} for i in range(3)]
    scored = asyncio.run(
        ascore_rows(Client(), tokenizer, lambda p, c, a=None, **k: float(c == a), rows, cfg, params, samples=samples)
    )
    assert seen == [False] * 3 * samples and len(decoded) == 3 * samples
    assert [t.reward for ts in scored for t in ts] == [1.0] * 3 * samples


def test_the_rows_file_keeps_each_listed_functions_score_per_completion(trained, tmp_path):
    """``reward.fn`` as a list: each row's ``rewards`` are the weighted sums, its ``reward_figures`` each
    function's own score per completion, and the summary's metrics each function's mean."""
    root, _, _ = trained
    cfg = load_config(
        None, [*_overrides(root), f"reward.fn=[{REWARD},tests.helpers.rewards:half]", "reward.weights=[1,2]"]
    )
    summary = run_eval(cfg, EvalOptions(checkpoint="latest", out=str(tmp_path / "rows.jsonl")))
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    firsts = []
    for row in rows:
        assert [f["half"] for f in row["reward_figures"]] == [0.5] * len(row["rewards"])
        assert row["rewards"] == [f["first_char"] + 2 * 0.5 for f in row["reward_figures"]]
        firsts += [f["first_char"] for f in row["reward_figures"]]
    assert summary["metrics"]["eval/reward/first_char_mean"] == pytest.approx(sum(firsts) / len(firsts))
    assert summary["metrics"]["eval/reward/half_mean"] == 0.5
