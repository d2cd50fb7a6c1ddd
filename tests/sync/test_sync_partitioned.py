"""``cluster.sync_commit=inplace`` end to end: a partitioned CPU run (1 training + 1 rollout worker
process) whose policy syncs write the rollout engine's weights in place repeats the staged run."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer  # noqa: F401 - imported before worker threads race to import it

from areno.api.config import ConfigError, load_config
from tests.helpers.configs import tiny_run_overrides


def _config(tmp_path, commit: str):
    return load_config(
        None,
        [
            *tiny_run_overrides(tmp_path, commit),
            "cluster.train_devices=[0]",
            "cluster.rollout_devices=[1]",
            f"cluster.sync_commit={commit}",
        ],
    )


def test_sync_commit_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="cluster.sync_commit: must be staged or inplace, got 'swap'"):
        _config(tmp_path, "swap")


@pytest.mark.slow
def test_inplace_sync_commit_repeats_the_staged_run(tmp_path):
    from areno.engine.api import prepare_model_dir
    from areno.engine.placement import partitioned_engine

    runs = {}
    for commit in ("staged", "inplace"):
        cfg = _config(tmp_path, commit)
        prepare_model_dir(cfg)
        engine = partitioned_engine(cfg, tmp_path / commit)
        engine.initialize()
        try:
            steps = []
            for i in range(3):
                rollout = engine.generate_rollout(i)
                metrics = engine.step(rollout)
                engine.update_weights()
                samples = sorted((t.prompt_ids, t.completion_ids, t.logprobs, t.versions) for t in rollout.trajectories)
                steps.append((samples, metrics))
            runs[commit] = (steps, engine.rollout.cluster.scheduler.call("rollout", "version"))
        finally:
            engine.shutdown()
    (staged, v_staged), (inplace, v_inplace) = runs["staged"], runs["inplace"]
    assert v_staged == v_inplace == [3]
    for (samples_s, m_s), (samples_i, m_i) in zip(staged, inplace):
        # the same policy reached the engine at every step: the same tokens and versions, and log-probs equal
        # but for their last bits, which follow how the engine batched the rows (the order requests arrive
        # from the other process); a policy one version apart moves them by far more
        assert [(p, c, v) for p, c, _, v in samples_s] == [(p, c, v) for p, c, _, v in samples_i]
        for (*_, lp_s, _), (*_, lp_i, _) in zip(samples_s, samples_i):
            assert lp_s == pytest.approx(lp_i, rel=1e-6, abs=1e-6)
        numerics = [k for k in m_s if k.startswith(("policy/", "train/")) and "time" not in k and "_s" not in k[-2:]]
        close = all(m_s[k] == pytest.approx(m_i[k], rel=1e-5, abs=1e-7) for k in numerics)
        assert numerics and close, {k: (m_s[k], m_i[k]) for k in numerics}
    # the in-place engine stopped generating for its whole sync; the staged one only to commit
    m_s, m_i = staged[-1][1], inplace[-1][1]
    assert m_i["policy_sync_generation_paused_s"] > m_s["policy_sync_generation_paused_s"]
