"""Shared pieces of the recipe tests: a tiny decoder, fixed packed batches (RL groups, preference
pairs), a naive (unpacked, full-logits) log-prob reference, hand-computed GRPO advantages and a
plain Reducer."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from areno import train
from areno.models.decoder import Decoder
from areno.models.hf_io import tiny_config
from areno.recipes import TRAINING_CONFIGS
from areno.types import TokenBatch, Trajectory

VOCAB = 24

# Tiny matmuls are slower with many intra-op threads on a shared, loaded CPU.
torch.set_num_threads(1)


def make_decoder(seed: int, **kw) -> Decoder:
    """A tiny decoder (``kw``: ``tiny_config`` fields, e.g. another ``arch``)."""
    torch.manual_seed(seed)
    # a large init std makes the next-token distributions far from uniform, so ratios, clips and
    # KL terms are exercised with non-trivial values
    return Decoder(tiny_config(VOCAB, hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3, **kw))


def model_fixture() -> Decoder:
    return make_decoder(0)


def group_batch_of(
    specs: list[tuple[str, float, int, int]], *, seed: int, vocab: int = VOCAB, version: int = 3
) -> TokenBatch:
    """Sequences of random tokens, one per ``(group_id, reward, prompt tokens, completion tokens)``."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for gid, reward, n_prompt, n_comp in specs:
        ids = torch.randint(3, vocab, (n_prompt + n_comp,), generator=gen).tolist()
        trajs.append(
            Trajectory(
                prompt_ids=ids[:n_prompt],
                completion_ids=ids[n_prompt:],
                logprobs=[0.0] * n_comp,
                versions=[version] * n_comp,
                reward=reward,
                group_id=gid,
            )
        )
    return TokenBatch.from_trajectories(trajs)


def rl_batch() -> TokenBatch:
    """6 sequences in 3 groups; group c has equal rewards (dynamic sampling drops it)."""
    specs = [("a", 1.0, 3, 4), ("a", 0.0, 3, 2), ("b", 0.2, 2, 5), ("b", 1.0, 2, 3), ("c", 1.0, 4, 2), ("c", 1.0, 4, 3)]
    return group_batch_of(specs, seed=1)


def tiny_policy_dir(root: Path) -> str:
    """A two-layer char-level policy checkpoint under ``root`` (the skip and runner-metrics tests' model)."""
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3)
    return str(init_model_dir(root / "policy", cfg, tok, seed=0))


def rl_batch_for(policy_dir: str, rewards: list[float] | None = None) -> TokenBatch:
    """``rl_batch`` (``rewards`` replacing its rewards) with behaviour log-probs near the policy's own."""
    from areno.models.hf_io import load_model

    batch = rl_batch()  # 6 sequences in groups a, a, b, b, c, c; group c's rewards are equal
    if rewards is not None:
        batch.rewards_B = torch.tensor(rewards, dtype=torch.float32)
    logp = naive_logprobs(load_model(policy_dir, dtype=torch.float32, device="cpu")[0], batch)
    return with_behaviour_logprobs(batch, logp, scale=0.3)


def with_behaviour_logprobs(batch: TokenBatch, logp_T: torch.Tensor, seed: int = 2, scale: float = 0.3) -> TokenBatch:
    """Behaviour log-probs = the model's own plus noise (so ratios differ from 1 and some clip)."""
    gen = torch.Generator().manual_seed(seed)
    noise_T = scale * torch.randn(batch.num_tokens, generator=gen)
    batch.logprobs_T = torch.where(batch.loss_mask_T, logp_T.detach() + noise_T, torch.zeros(()))
    return batch


@torch.no_grad()
def naive_logprobs(model: Decoder, batch: TokenBatch, targets_T: torch.Tensor | None = None) -> torch.Tensor:
    """Reference log-probs: each sequence alone, full fp32 log-softmax, aligned like TokenBatch."""
    targets_T = batch.input_ids_T if targets_T is None else targets_T
    out = torch.zeros(batch.num_tokens)
    cu = batch.cu_seqlens_B1.tolist()
    for b in range(batch.num_seqs):
        ids = batch.input_ids_T[cu[b] : cu[b + 1]]
        hidden = model(ids, torch.arange(ids.numel()))
        logp = torch.log_softmax(model.logits(hidden).float(), -1)
        for t in range(1, ids.numel()):
            out[cu[b] + t] = logp[t - 1, targets_T[cu[b] + t]]
    return out


class PlainReducer:
    def __init__(self, denominator: float) -> None:
        self.denominator = denominator

    def __call__(self, values, mask=None):
        if mask is not None:
            values = values * mask.to(values.dtype)
        return values.sum() / self.denominator

    def gather(self, values):  # one process: its own values (Reducer.gather)
        return values


def loss_of(spec, model, batch):
    """compute_loss of one whole-batch micro-batch, as the backend would call it."""
    reducer = PlainReducer(spec.denominator(batch))
    out = spec.extract_model_output(model, batch)
    return spec.compute_loss(out, batch, reducer)


def completion_positions(batch: TokenBatch, b: int) -> list[int]:
    cu = batch.cu_seqlens_B1.tolist()
    return [t for t in range(cu[b], cu[b + 1]) if batch.loss_mask_T[t]]


def grpo_adv(rewards: list[float], std: bool = True) -> list[float]:
    """Group advantages of a.., b.., c.. groups of two, by hand."""
    out = []
    for i in range(0, len(rewards), 2):
        r0, r1 = rewards[i], rewards[i + 1]
        mean = (r0 + r1) / 2
        sd = math.sqrt((r0 - mean) ** 2 + (r1 - mean) ** 2)  # n-1 = 1
        for r in (r0, r1):
            out.append((r - mean) / (sd + 1e-4) if std else r - mean)
    return out


def preference_batch() -> TokenBatch:
    gen = torch.Generator().manual_seed(3)
    trajs = []
    for gid, reward, n_prompt, n_comp in [("p", 1.0, 3, 3), ("q", 0.0, 2, 4), ("p", 0.0, 3, 2), ("q", 1.0, 2, 3)]:
        ids = torch.randint(3, 24, (n_prompt + n_comp,), generator=gen).tolist()
        trajs.append(
            Trajectory(
                prompt_ids=ids[:n_prompt],
                completion_ids=ids[n_prompt:],
                logprobs=[-1.0] * n_comp,
                versions=[0] * n_comp,
                reward=reward,
                group_id=gid,
            )
        )
    return TokenBatch.from_trajectories(trajs)


@contextlib.contextmanager
def saved_registry() -> Iterator[None]:
    """The recipe registry as it was, after the block (recipes a test registers go)."""
    saved = dict(TRAINING_CONFIGS)
    try:
        yield
    finally:
        TRAINING_CONFIGS.clear()
        TRAINING_CONFIGS.update(saved)


@contextlib.contextmanager
def user_code_dir(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """``tmp_path`` as the working directory of a user's recipe modules; sys.path, the modules imported
    from it and the recipe registry restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with saved_registry():
        try:
            yield tmp_path
        finally:
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
                    del sys.modules[name]


class RecordingBackend:
    """A TrainBackend stand-in that records calls; ``barrier`` makes concurrent roles meet; ``hold_s``
    keeps each train_step that long, so roles run concurrently overlap in the log."""

    def __init__(self, log, barrier=None, hold_s: float = 0.0):
        self.log, self.barrier, self.hold_s = log, barrier, hold_s
        self.cfg = train.TrainBackendConfig(trainable=True, device="cpu")

    def forward_only(self, batch, *, forward_fn):
        self.log.append(("forward", id(self)))
        T = batch.num_tokens
        return {"logprobs_T": torch.zeros(T), "argmax_T": torch.zeros(T, dtype=torch.long), "values_T": torch.zeros(T)}

    def train_step(self, batch, *, forward_fn, loss_fn, denominator_fn):
        self.log.append(("enter", threading.current_thread().name))
        if self.barrier is not None:
            self.barrier.wait()  # both roles must be inside train_step at the same time
        time.sleep(self.hold_s)
        self.log.append(("exit", threading.current_thread().name))
        return {"loss": 0.0}


RM_TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}
"""The decoder shape of ``save_reward_model``'s reward models."""


def save_reward_model(out: Path, *, num_labels: int = 1, tokenizer=None, seed: int = 11) -> Path:
    """A random Qwen2ForSequenceClassification saved by transformers at ``out``, with the char tokenizer
    (the tiny runs' policies'); its head larger than transformers' init, so scores vary visibly."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir

    tok = tokenizer or build_char_tokenizer()
    causal = init_model_dir(out.parent / f"{out.name}_causal", tiny_config(len(tok), **RM_TINY), tok, seed=seed)
    cfg = AutoConfig.from_pretrained(causal, num_labels=num_labels)
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():
        model.score.weight.normal_(std=1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
