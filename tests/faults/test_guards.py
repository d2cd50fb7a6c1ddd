"""Guards: a non-finite loss or grad norm skips the optimizer step and is counted; a run stops with
one line after ``max_consecutive_skips`` skipped steps in a row instead of training on garbage;
non-finite optimizer settings are config errors, and parameters that became NaN/inf stop the run
before they are saved."""

import math

import pytest
import torch

from areno.api.config import ConfigError, load_config
from areno.train import LocalTrainBackend, TrainBackendConfig
from areno.train.optim import NonFiniteParametersError, NonFiniteStepError
from tests.helpers.configs import train_args
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, token_denominator

VOCAB = 40
LENGTHS = [5, 7, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("guards"), hidden=32, layers=1)


def _backend(model_dir, **kw) -> LocalTrainBackend:
    b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", **kw))
    b.initialize(model_dir)
    return b


def _nan_constant_loss(output, mb, reducer):
    """Finite gradients, non-finite loss: the grad-norm check alone would let this step through."""
    loss, metrics = nll_loss(output, mb, reducer)
    return loss + torch.tensor(float("nan")), metrics


def _nan_loss(output, mb, reducer):
    return reducer(-output["logprobs_T"] * float("nan"), mb.loss_mask_T), {}


def _step(b, loss_fn=nll_loss, seed=0):
    return b.train_step(
        random_batch(LENGTHS, VOCAB, seed), forward_fn=nll_forward, loss_fn=loss_fn, denominator_fn=token_denominator
    )


def test_non_finite_loss_with_finite_grads_skips_the_step(model_dir):
    torch.set_num_threads(1)
    b = _backend(model_dir)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    m = _step(b, _nan_constant_loss)
    assert math.isfinite(m["grad_norm"]) and not math.isfinite(m["loss"])
    assert m["skipped_steps"] == 1 and m["consecutive_skips"] == 1 and m["lr"] == 0.0
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, before[k]), k  # no optimizer step, not even weight decay / moments
    assert all(p.grad is None for p in b.model.parameters())
    assert b.optimizer.state == {}  # Adam moments never saw the garbage step
    # a good step afterwards trains and resets the consecutive count, keeps the total
    m = _step(b, seed=1)
    assert m["skipped_steps"] == 1 and m["consecutive_skips"] == 0 and m["lr"] > 0


def test_consecutive_skips_stop_with_one_line(model_dir):
    b = _backend(model_dir, max_consecutive_skips=3, role_name="actor")
    _step(b, _nan_loss)
    _step(b, _nan_loss)
    _step(b, seed=2)  # a finite step in between resets the streak
    _step(b, _nan_loss)
    _step(b, _nan_loss)
    with pytest.raises(NonFiniteStepError) as info:
        _step(b, _nan_constant_loss)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)  # the CLI prints it as one line
    assert "role 'actor' skipped 3 optimizer steps in a row" in message and "step 6" in message
    assert "train.max_consecutive_skips" in message and "optim.lr" in message
    assert b._skipped_steps == 5


def test_zero_never_stops_and_default(model_dir):
    assert TrainBackendConfig().max_consecutive_skips == 5
    b = _backend(model_dir, max_consecutive_skips=0)
    for _ in range(6):
        m = _step(b, _nan_loss)
    assert m["skipped_steps"] == 6 and m["consecutive_skips"] == 6


def test_consecutive_count_survives_a_checkpoint(model_dir, tmp_path):
    b = _backend(model_dir, max_consecutive_skips=3)
    _step(b, _nan_loss)
    _step(b, _nan_loss)
    b.save_checkpoint(tmp_path / "ckpt", extra_state={})
    fresh = _backend(model_dir, max_consecutive_skips=3)
    fresh.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(NonFiniteStepError, match="3 optimizer steps in a row"):
        _step(fresh, _nan_loss)


def test_config_field():
    assert load_config(None, ["model.path=x"]).train.max_consecutive_skips == 5
    assert load_config(None, ["model.path=x", "train.max_consecutive_skips=0"]).train.max_consecutive_skips == 0
    with pytest.raises(ConfigError, match="train.max_consecutive_skips: must be >= 0"):
        load_config(None, ["model.path=x", "train.max_consecutive_skips=-1"])


@pytest.mark.parametrize(
    "setting", ["optim.lr=inf", "optim.lr=nan", "optim.lr=-inf", "optim.weight_decay=inf", "optim.grad_clip=nan"]
)
def test_non_finite_optim_setting_is_a_config_error(setting):
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: must be a finite number"):
        load_config(None, ["model.path=x", setting])


def _poison(b: LocalTrainBackend) -> None:
    with torch.no_grad():
        for p in b.model.parameters():
            p.view(-1)[0] = float("inf")


def test_non_finite_parameters_are_never_saved(model_dir, tmp_path):
    b = _backend(model_dir)
    _step(b)
    _poison(b)
    with pytest.raises(NonFiniteParametersError, match="NaN/inf after step 1 .*before saving"):
        b.save_checkpoint(tmp_path / "ckpt", {})
    assert not (tmp_path / "ckpt").exists()


def test_skipped_step_on_non_finite_parameters_stops_at_once(model_dir):
    """Skipping cannot repair a diverged model: stop at the first skip, not after five."""
    b = _backend(model_dir)
    _step(b)
    _poison(b)
    with pytest.raises(NonFiniteParametersError, match="after step 2"):
        _step(b)


def test_a_checkpoint_with_non_finite_weights_is_named_not_the_learning_rate(model_dir, tmp_path):
    """walk31: NaN weights in model.safetensors were blamed on the loss, with "lower optim.lr" as the fix."""
    import shutil

    from safetensors.torch import load_file, save_file

    from areno.errors import ModelDirError

    poisoned = shutil.copytree(model_dir, tmp_path / "poisoned")
    weights = load_file(poisoned / "model.safetensors")
    next(iter(weights.values())).view(-1)[0] = float("nan")
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    b = _backend(poisoned)
    with pytest.raises(ModelDirError, match=f"{poisoned} holds NaN/inf weights .*re-export or re-download"):
        _step(b)


@pytest.mark.parametrize("lr", ["inf", "1e300"])
def test_cli_refuses_a_non_finite_or_overflowing_lr_in_one_line(tmp_path, capsys, lr):
    """optim.lr=inf used to train and save an all-NaN checkpoint with exit 0; 1e300 overflowed float32
    in the first update with a raw traceback."""
    from areno.cli import main

    rc = main(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", f"optim.lr={lr}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("areno: error: optim.lr: must be"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_diverged_run_stops_with_one_line(tmp_path, capsys):
    """optim.lr=1e30 blows the weights up after one step; every later loss is NaN. The run must
    stop after the default 5 skipped steps with exit code 2 and one line, not run to the end."""
    from areno.cli import main

    rc = main(
        [
            "train",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
            "data.task=arithmetic",
            "data.num_eval=4",
            "rollout.batch_size=2",
            "rollout.n_samples=8",
            "rollout.max_new_tokens=8",
            "cluster.device=cpu",
            "observe.console=false",
            "reward.fn=tests.helpers.rewards:digit_fraction",
            "optim.lr=1e30",
            "optim.grad_clip=0",
            "train.steps=20",
            "train.eval_interval=0",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("areno: error: ") and "5 optimizer steps in a row" in err[-1]
    import json

    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "train/policy/skipped_steps" in s]
    assert trained[-1]["train/policy/skipped_steps"] == 4 and len(trained) < 20  # the 5th raised before logging


def _broken_run(tmp_path, capsys, *extra: str) -> tuple[int, list[str]]:
    """A tiny CLI run whose every episode raises; returns the exit code and stderr's lines."""
    from areno.cli import main

    rc = main(
        train_args(
            tmp_path,
            "rollout.workflow=tests.helpers.workflows:AlwaysFailingWorkflow",
            "rollout.max_retries=0",
            "rollout.max_consecutive_dropped=3",
            "train.steps=5",  # after train_args' train.steps=1: the later value wins
            "train.eval_interval=0",
            *extra,
        )
    )
    return rc, capsys.readouterr().err.strip().splitlines()


def test_broken_rollout_side_stops_the_run_with_one_line(tmp_path, capsys):
    """Every episode fails: a synchronous rollout batch without any trajectory stops the run with
    exit code 1 and one line naming the last error, instead of failing later in the metrics."""
    rc, err = _broken_run(tmp_path, capsys)
    assert rc == 1 and err[-1].startswith(
        "areno: error: no trajectories from a rollout batch of 2 samples: 2 dropped after 1 attempts each"
    )
    assert "RuntimeError: environment unreachable" in err[-1]
    assert "AlwaysFailingWorkflow.run_episode raised it in its own code" in err[-1]


def test_broken_rollout_side_stops_an_asynchronous_run_with_one_line(tmp_path, capsys):
    """The same with the everlasting pool (eta 1): rollout.max_consecutive_dropped samples in a row."""
    rc, err = _broken_run(tmp_path, capsys, "rollout.max_head_offpolicyness=1", "train.algorithm=grpo_async")
    assert rc == 1 and err[-1].startswith("areno: error: the last 3 samples were all dropped after 1 attempts each")
    assert "RuntimeError: environment unreachable" in err[-1]


def test_a_rollout_side_broken_mid_run_saves_the_steps_trained(tmp_path, capsys):
    """walk23: a rollout pool that broke after some steps (every sample dropped: an environment, reward
    service or a stalled rollout worker with cluster.worker_stall_s=0) ended the run without an emergency
    checkpoint, although the training side was intact: every step since the last checkpoint was lost."""
    rc, err = _broken_run(
        tmp_path,
        capsys,
        "rollout.workflow=tests.helpers.workflows:BreaksAfterWorkflow",
        "rollout.workflow_kwargs={break_after: 4}",
        "train.save_interval=100",
    )
    assert rc == 1 and "no trajectories from a rollout batch" in err[-1]
    assert "saved an emergency checkpoint of step 2" in err[-1]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()


@pytest.mark.parametrize(
    "extra",
    [(), ("rollout.max_head_offpolicyness=1", "train.algorithm=grpo_async")],
    ids=["synchronous", "asynchronous"],
)
def test_lost_rollout_servers_stop_the_run_at_once_with_one_line(tmp_path, capsys, extra):
    """No retries (rollout.max_retries=3 here), no samples dropped one by one: the first episode's
    RolloutServersLost ends the run with exit code 1 and its own message."""
    rc, err = _broken_run(
        tmp_path,
        capsys,
        "rollout.workflow=tests.helpers.workflows:ServersLostWorkflow",
        "rollout.max_retries=3",
        *extra,
    )
    assert rc == 1 and err[-1] == (
        "areno: error: every rollout server is gone: http://127.0.0.1:1: rollout[0] (pid 7) died"
    )
    assert not any("retrying" in line or "dropping dataset" in line for line in err)


def test_non_finite_weights_after_a_resume_name_the_checkpoint(model_dir, tmp_path):
    """walk32: after load_checkpoint, weights no update produced came from the checkpoint, not model.path."""
    from areno.errors import ModelDirError

    b = _backend(model_dir)
    _step(b)
    b.save_checkpoint(tmp_path / "ckpt", {})
    resumed = _backend(model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    _poison(resumed)  # as if the checkpoint's weights held them
    with pytest.raises(ModelDirError, match=f"{tmp_path / 'ckpt'} holds NaN/inf weights"):
        _step(resumed)
