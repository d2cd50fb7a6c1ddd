"""ArenoEngine: owns the workers used by both rollout and training (seed 000).

Colocated (the default) means one process per device holds the training backends of the recipe's
roles and the embedded rollout engine; the rollout engine gets the new policy through the in-place
transport (a dtype cast at most) when ``update_weights`` is called, i.e. before the next rollout.

    generate_rollout(rollout_id)  prompts -> WorkflowExecutor -> RolloutWorkflow.run_episode
                                   -> RolloutClient -> RolloutEngine; trajectories -> TokenBatch
    step(rollout)                  RecipeRunner: inject syncs, then each trainable role trains
    update_weights()               sync_to_rollout roles -> rollout engine, version + 1
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch

from areno.data.datasets import build_splits
from areno.data.tasks import PromptStream
from areno.engine.config import ArenoConfig, build_rollout_engine_config, build_train_backend_config, resolve_dtypes
from areno.engine.ledger import SEQ_KEY, LedgerWorkflow, ResumableStaleness, SampleLedger, SeedingClient
from areno.faults import fault_point
from areno.rewards.sandbox import RewardSandbox, release_shared
from areno.rollout.store import release_refs
from areno.train import checkpoint
from areno.types import RolloutBatch, SamplingParams, TokenBatch, Trajectory

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    return torch.device(name)


def rollout_engine_config(cfg: ArenoConfig, *, device: str, dtype: str, num_blocks: int = 0):
    """The ``RolloutEngineConfig`` of a rollout engine from the ``rollout`` section (colocated and
    partitioned alike); ``num_blocks`` 0 sizes the KV pool automatically."""
    return build_rollout_engine_config(
        cfg, device=device, dtype=dtype, max_num_seqs=rollout_max_num_seqs(cfg), num_blocks=num_blocks
    )


def rollout_sequences_in_flight(cfg: ArenoConfig) -> int:
    """Sequences a run can have in flight at once: at most eta + 1 batches of episodes (the staleness
    capacity), each of ``n_samples`` sequences, and no more than ``max_concurrent`` episodes."""
    r = cfg.rollout
    return min(r.max_concurrent, r.batch_size * (r.max_head_offpolicyness + 1)) * r.n_samples


AUTO_MAX_NUM_SEQS = (256, 1024)
"""Bounds of the rollout engine's running batch when ``rollout.max_num_seqs`` is 0 (automatic)."""


def rollout_max_num_seqs(cfg: ArenoConfig) -> int:
    """The rollout engine's running-batch limit: ``rollout.max_num_seqs``, or (0) the run's sequences
    in flight within ``AUTO_MAX_NUM_SEQS``."""
    if cfg.rollout.max_num_seqs:
        return cfg.rollout.max_num_seqs
    lo, hi = AUTO_MAX_NUM_SEQS
    return max(lo, min(rollout_sequences_in_flight(cfg), hi))


def rollout_sampling_params(cfg: ArenoConfig, *, greedy: bool) -> SamplingParams:
    """The sampling of training rollouts (``rollout`` section), or greedy (evaluation)."""
    r = cfg.rollout
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens)
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)


def warm_up_rollout_engine(engine, cfg: ArenoConfig) -> int:
    """Capture the rollout engine's decode CUDA graphs now (``rollout.cuda_graph_warmup``): batch
    sizes up to the run's concurrency in sequences, contexts up to ``max_new_tokens`` + 256 prompt
    tokens (longer contexts capture their graphs at first use), the training rollouts' sampling and
    greedy evaluation. Returns the graphs held; 0 without CUDA graphs (CPU, or turned off)."""
    r = cfg.rollout
    if not r.cuda_graph_warmup or not r.cuda_graphs or engine.device.type != "cuda":
        return 0
    t0 = time.perf_counter()
    # training requests carry seeds (SeedingClient: a hashed uniform per row, its own graph mode)
    params = [dataclasses.replace(rollout_sampling_params(cfg, greedy=False), seed=0)]
    if cfg.data.num_eval and cfg.train.eval_interval:
        params.append(rollout_sampling_params(cfg, greedy=True))
    in_flight = rollout_sequences_in_flight(cfg)
    if cfg.data.num_eval and cfg.train.eval_interval:
        in_flight = max(in_flight, cfg.data.num_eval)
    try:
        held = engine.warmup_cuda_graphs(list(range(1, in_flight + 1)), r.max_new_tokens + 256, params)
    except (RuntimeError, torch.OutOfMemoryError) as exc:  # graphs are then captured at first use
        logger.warning(
            "rollout engine: CUDA graph warm-up failed after %.1f s (%s: %s); graphs are captured "
            "when first needed instead (rollout.cuda_graph_warmup=false skips the warm-up)",
            time.perf_counter() - t0,
            type(exc).__name__,
            exc,
        )
        return 0
    logger.info(
        "rollout engine: %d decode CUDA graphs captured in %.1f s (rollout.cuda_graph_warmup)",
        held,
        time.perf_counter() - t0,
    )
    return held


def build_role_backends(cfg: ArenoConfig, recipe, model_dir: Path, new_backend) -> dict:
    """One initialised training backend per recipe role, configured alike colocated and
    partitioned: ``new_backend(TrainBackendConfig)`` makes it (one process, or FSDP2 over a training
    sub-mesh); each role loads its own checkpoint (``role.model_path``, else ``model_dir``) and its
    specialization may wrap the model (value and reward heads)."""
    backends = {}
    for role in recipe.roles:
        backend = new_backend(build_train_backend_config(cfg, role_name=role.name, trainable=role.trainable))
        backend.initialize(Path(role.model_path or model_dir), wrap_model=role.build().wrap_model)
        backends[role.name] = backend
    if cfg.train.compile and any(role.trainable for role in recipe.roles):
        logger.info(
            "training: train.compile=true compiles the decoder (train.compile_scope=%s) during the first "
            "training step%s; later runs reuse torch's compile cache",
            cfg.train.compile_scope,
            " (the whole layer stack as one graph: minutes on a GPU)" if cfg.train.compile_scope == "model" else "",
        )
    return backends


def prepare_model_dir(config: ArenoConfig) -> Path:
    """The checkpoint directory, created from ``model.init_tiny`` when asked to; else it must exist."""
    path = Path(config.model.path)
    if not (path / "config.json").is_file() and config.model.init_tiny is not None:
        from areno.data.tokenizer import build_char_tokenizer
        from areno.models.hf_io import init_model_dir, tiny_config

        tokenizer = build_char_tokenizer()
        init_model_dir(path, tiny_config(len(tokenizer), **config.model.init_tiny), tokenizer, seed=config.train.seed)
    if not path.is_dir():
        raise ValueError(f"model.path: directory {path} does not exist: point it at a local Hugging Face checkpoint")
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: {path} has no config.json: is it a Hugging Face checkpoint directory?")
    return path


def resolve_recipe(config: ArenoConfig):
    """The recipe of ``train.algorithm`` with ``train.algorithm_kwargs`` applied; online recipes
    recompute log-probs under the rollouts' sampling temperature. Unknown recipe, bad kwargs, a
    teacher role without checkpoint: a ValueError here, before any model loads."""
    from areno.recipes import get_recipe

    policy_kwargs = dict(config.train.algorithm_kwargs)
    recipe = get_recipe(config.train.algorithm, policy_kwargs=policy_kwargs)
    if recipe.online and "temperature" not in policy_kwargs and config.rollout.temperature > 0:
        recipe = get_recipe(
            config.train.algorithm, policy_kwargs={**policy_kwargs, "temperature": config.rollout.temperature}
        )
    return recipe


def sft_trajectories(rows: list[dict], tokenizer, prompt_key: str, answer_key: str) -> list[Trajectory]:
    """Offline data for supervised recipes: prompt, then the reference answer and EOS as completion."""
    out = []
    for row in rows:
        prompt_ids = tokenizer.encode(row[prompt_key])
        completion_ids = tokenizer.encode(str(row[answer_key])) + [tokenizer.eos_token_id]
        n = len(completion_ids)
        out.append(
            Trajectory(
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                logprobs=[0.0] * n,
                versions=[0] * n,
                reward=0.0,
                info={"prompt": row[prompt_key]},
            )
        )
    return out


def rollout_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    rewards = torch.tensor([t.reward for t in trajectories])
    lengths = torch.tensor([len(t.completion_ids) for t in trajectories], dtype=torch.float32)
    versions = [v for t in trajectories for v, m in zip(t.versions, t.completion_mask) if m]
    staleness = torch.tensor([version - v for v in versions], dtype=torch.float32) if versions else torch.zeros(1)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(trajectories) > 1 else 0.0,
        "rollout/completion_len_mean": lengths.mean().item(),
        "rollout/num_seqs": float(len(trajectories)),
        "rollout/num_tokens": float(sum(t.num_tokens for t in trajectories)),
        "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        "rollout/reward_errors": float(sum("reward_error" in t.info for t in trajectories)),
        "rollout/staleness_mean": staleness.mean().item(),
        "rollout/staleness_max": staleness.max().item(),
    }


class ArenoEngine:
    """Coordinates the colocated worker: training backends, rollout engine, rollout pool."""

    # set in __init__
    config: ArenoConfig
    run_dir: Path
    # set in initialize()
    device: torch.device
    tokenizer: object
    recipe: object
    runner: object
    rollout_engine: object
    executor: object
    train_stream: PromptStream
    ledger: SampleLedger | None = None
    """Online recipes: hands out the prompts, keeps those not yet trained (the data cursor an
    asynchronous pool runs ahead of) and their stream keys (the episodes' sampling seeds)."""
    eval_rows: list[dict]
    version: int = 0
    asynchronous: bool = False
    """True when max_head_offpolicyness > 0: the rollout pool runs ahead of training."""
    _pending_sync_metrics: dict[str, float]

    def __init__(self, config: ArenoConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self._pending_sync_metrics = {}
        self._transports = {}

    # ----------------------------------------------------------------------------- set-up
    def initialize(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.config
        self.recipe = resolve_recipe(cfg)  # errors before any model loads
        train_rows, self.eval_rows = build_splits(cfg.data)  # malformed rows: error before models load
        self.train_stream = PromptStream(train_rows, seed=cfg.data.seed)
        self.device = resolve_device(cfg.cluster.device)
        if cfg.cluster.cpu_threads:
            torch.set_num_threads(cfg.cluster.cpu_threads)
        model_dir = prepare_model_dir(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"model.path: the tokenizer in {model_dir} has no eos_token: set one in tokenizer_config.json"
            )
        torch.manual_seed(cfg.train.seed)
        self.runner = self._build_runner(model_dir)
        self.rollout_engine = self._build_rollout_engine(model_dir)
        warm_up_rollout_engine(self.rollout_engine, cfg)
        from areno.rollout.client import InProcessRolloutClient

        # The one driver of the rollout engine: rollouts and evaluation both go through it.
        self.client = InProcessRolloutClient(self.rollout_engine, request_timeout_s=cfg.rollout.request_timeout_s)
        self.executor = self._build_executor() if self.recipe.online else None
        self.asynchronous = self.recipe.online and cfg.rollout.max_head_offpolicyness > 0

    def _build_runner(self, model_dir: Path):
        from areno.recipes.runner import RecipeRunner
        from areno.train import LocalTrainBackend

        device = self.device.type
        backends = build_role_backends(
            self.config, self.recipe, model_dir, lambda c: LocalTrainBackend(dataclasses.replace(c, device=device))
        )
        return RecipeRunner(self.recipe, backends, num_minibatches=self.config.train.num_minibatches)

    def _build_rollout_engine(self, model_dir: Path):
        from areno.models.hf_io import load_model
        from areno.rollout.engine import RolloutEngine

        dtype_name = resolve_dtypes(self.config, self.device.type).rollout
        dtype = getattr(torch, dtype_name)
        model, model_config = load_model(model_dir, dtype=dtype, device=str(self.device))
        engine_cfg = rollout_engine_config(
            self.config, device=str(self.device), dtype=dtype_name, num_blocks=self.config.rollout.kv_blocks
        )
        return RolloutEngine(
            model,
            model_config,
            config=engine_cfg,
            eos_token_ids=[self.tokenizer.eos_token_id],
            tokenizer=self.tokenizer,
        )

    def _build_executor(self):
        from areno.engine.executor import WorkflowExecutor
        from areno.rewards.loader import load_reward
        from areno.rollout.store import InProcessStore
        from areno.workflows.base import load_workflow
        from areno.workflows.common import store_kwargs

        cfg = self.config
        reward_fn = self.reward_fn = load_reward(cfg.reward)
        # one observation store: workflows taking `store=` put large observations there; the
        # executor frees those of dropped groups, step() those of trained ones
        self.store = InProcessStore()
        workflow = load_workflow(
            cfg.rollout.workflow,
            tokenizer=self.tokenizer,
            reward_fn=reward_fn,
            n_samples=cfg.rollout.n_samples,
            sampling_params=rollout_sampling_params(cfg, greedy=False),
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            **store_kwargs(cfg.rollout.workflow, self.store, cfg.rollout.workflow_kwargs),
            **cfg.rollout.workflow_kwargs,
        )
        staleness = ResumableStaleness(
            max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
            batch_size=cfg.rollout.batch_size,
            max_concurrent=cfg.rollout.max_concurrent,
        )
        # The ledger hands out the prompts and keeps the cursor of what was trained (the pool reads
        # ahead of training); episodes sample with seeds from their place in the data order.
        self.ledger = SampleLedger(self.train_stream)
        workflow = LedgerWorkflow(workflow, self.ledger, max_retries=cfg.rollout.max_retries, seed=cfg.train.seed)
        return WorkflowExecutor(
            SeedingClient(self.client),
            workflow,
            self.ledger,
            staleness,
            num_workers=cfg.rollout.max_concurrent,
            max_retries=cfg.rollout.max_retries,
            max_consecutive_dropped=cfg.rollout.max_consecutive_dropped,
            store=self.store,
        )

    # ----------------------------------------------------------------------------- the loop
    def generate_rollout(self, rollout_id: int) -> RolloutBatch:
        cfg = self.config
        if self.recipe.online and self.asynchronous:
            # everlasting pool: the oldest finished groups, generated up to η versions ago
            groups = self.executor.wait_batch(cfg.rollout.batch_size)
            self.ledger.trained([group[0].info.get(SEQ_KEY) for group in groups])
            trajectories = [t for group in groups for t in group]
            metrics = {**self.executor.metrics(), **rollout_metrics(trajectories, self.version)}
        elif self.recipe.online:
            samples = self.ledger.take(cfg.rollout.batch_size)
            seqs = [self.ledger.lookup(s)[0] for s in samples]
            engine = getattr(self, "rollout_engine", None)  # the partitioned engine's lives elsewhere
            if engine is not None:  # start the engine on the whole first burst (see SeedingClient)
                engine.pause()
                self.executor.client.hold(lambda: (engine.resume(), self.client.wake()))
            trajectories = self.executor.rollout_batch(samples)
            self.executor.client.release_now()
            self.ledger.trained(seqs)
            metrics = rollout_metrics(trajectories, self.version)
        else:
            rows = self.train_stream.take(cfg.rollout.batch_size)
            trajectories = sft_trajectories(rows, self.tokenizer, cfg.data.prompt_key, cfg.data.answer_key)
            metrics = {
                "rollout/num_seqs": float(len(trajectories)),
                "rollout/num_tokens": float(sum(t.num_tokens for t in trajectories)),
            }
        if isinstance(getattr(self, "reward_fn", None), RewardSandbox):  # calls, failures by kind, restarts
            metrics.update(self.reward_fn.metrics())
        return RolloutBatch(
            trajectories=trajectories, batch=TokenBatch.from_trajectories(trajectories), metrics=metrics
        )

    def step(self, rollout: RolloutBatch) -> dict[str, float]:
        for role_name in self.runner.roles_to_sync():  # the version the rollout policy carries (loglinear π_prox)
            self.runner.versions[role_name] = self.version
        # Asynchronous: the engine generates in its own thread meanwhile. No CUDA graph may be captured
        # beside the training step's kernels and device synchronizations (they invalidate a capture:
        # cudaErrorStreamCaptureUnsupported); a decode step needing a new graph meanwhile runs eagerly.
        hold = self.rollout_engine.hold_graph_captures() if self.asynchronous else contextlib.nullcontext()
        with hold:
            out = self.runner.step(rollout.batch, pass_order=rollout.pass_order)
        metrics = {f"train/{k}": v for k, v in out.items()}
        if getattr(self, "store", None) is not None and rollout.pass_order is None:
            # trained (later passes reuse the prepared batch): their stored observations are done with
            release_refs([t.info for t in rollout.trajectories], self.store)
        metrics.update(self._pending_sync_metrics)  # the previous sync's figures ride with the next step
        self._pending_sync_metrics = {}
        return metrics

    def update_weights(self) -> dict[str, float]:
        from areno.sync.base import NamedTensorSource
        from areno.sync.inplace import InPlaceTransport

        stats = None
        for role_name in self.runner.roles_to_sync():
            if role_name not in self._transports:
                source = NamedTensorSource(self.runner.backends[role_name].named_weights)
                self._transports[role_name] = InPlaceTransport(
                    source, self.rollout_engine.weight_tensors(), on_commit=self.rollout_engine.commit_weights
                )
            if self.asynchronous:  # bracket the swap: in-flight requests pause, then continue
                self.executor.pause()
                self.rollout_engine.pause()
            try:
                stats = self._transports[role_name].sync(self.version + 1)
            finally:
                if self.asynchronous:
                    self.executor.set_version(self.rollout_engine.version)
                    self.rollout_engine.resume()
                    self.client.wake()
                    self.executor.resume()
        if stats is None:
            return {}
        self.version += 1
        self._pending_sync_metrics = stats.as_metrics()
        return {}

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy (mean reward) of the current rollout policy."""
        if not self.eval_rows:
            return {}
        from areno.rewards.loader import load_reward
        from areno.workflows.common import acall_reward, sample_fields

        cfg = self.config
        if getattr(self, "reward_fn", None) is None:  # offline recipes build no executor
            self.reward_fn = load_reward(cfg.reward)
        reward_fn = self.reward_fn
        prompt_key, answer_key = cfg.data.prompt_key, cfg.data.answer_key
        params = rollout_sampling_params(cfg, greedy=True)
        t0 = time.perf_counter()

        client = self.client
        engine = getattr(self, "rollout_engine", None)
        held = engine is not None and not self.asynchronous
        if held:  # start the engine on the whole burst: the same batches, hence the same scores, every run
            client = SeedingClient(self.client)
            engine.pause()
            client.hold(lambda: (engine.resume(), self.client.wake()))

        async def ascore(row: dict) -> float:
            out = await client.agenerate(self.tokenizer.encode(row[prompt_key]), params)
            completion = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            # the rollouts' failure policy: a raising reward scores 0 and is warned about
            reward, _ = await acall_reward(
                reward_fn, row[prompt_key], completion, row.get(answer_key), sample_fields(row, prompt_key, answer_key)
            )
            return reward

        async def ascore_all() -> list[float]:
            return await asyncio.gather(*(ascore(row) for row in self.eval_rows))

        try:
            scores = asyncio.run(ascore_all())
        finally:
            if held:
                client.release_now()  # a no-op once the burst was released
        return {
            "eval/accuracy": sum(scores) / len(scores),
            "eval/num_prompts": float(len(scores)),
            "eval/time_s": time.perf_counter() - t0,
        }

    # ----------------------------------------------------------------------------- state
    def save(self, path: Path, trainer_state: dict) -> None:
        """Write the checkpoint into a staging directory, then publish it with one rename
        (``checkpoint.commit``): ``path`` exists only once it is whole."""
        state = {**trainer_state, **self.resume_state()}
        tmp = checkpoint.staging_dir(path)
        for role_name, backend in self.runner.backends.items():
            if backend.cfg.trainable:
                backend.save_checkpoint(tmp / role_name, extra_state=state)
        self.export_policy(tmp / "hf")  # what `transformers` and `areno serve` load
        fault_point("checkpoint_write", int(trainer_state.get("rollout_id", -1)) + 1)
        checkpoint.commit(tmp, path)

    def resume_state(self) -> dict:
        """What a checkpoint needs beyond the training backends' state: the data cursor (the
        stream's, plus the untrained samples of an asynchronous pool), the policy version and the
        rollout sampler's generator (a synchronous run then samples the same tokens after resume)."""
        state: dict = {
            "data": self.ledger.state_dict() if self.ledger is not None else self.train_stream.state_dict(),
            "version": self.version,
        }
        sampler = getattr(getattr(self, "rollout_engine", None), "sampler", None)
        if sampler is not None:
            state["rollout_rng"] = sampler.generator.get_state()
        return state

    def check_loadable(self) -> None:
        """A checkpoint loads only before an asynchronous engine's rollout pool starts (its samples in
        flight would be lost or trained twice): RuntimeError, before any weight is read, otherwise."""
        handed_out = self.ledger.num_handed_out if self.ledger is not None else 0
        if handed_out:
            raise RuntimeError(
                f"load(): this asynchronous engine's rollout pool has started ({handed_out} samples handed out); "
                "load a checkpoint into a new engine before its first rollout, as a resumed run does"
            )

    def load(self, path: Path) -> dict:
        self.check_loadable()
        state = {}
        for role_name, backend in self.runner.backends.items():
            if backend.cfg.trainable:
                state = backend.load_checkpoint(path / role_name)
        self._restore(state)
        return state

    def _restore(self, state: dict) -> None:
        """Data cursor, policy version and sampler state of a checkpoint (``resume_state``); the
        loaded weights go to the rollout side."""
        data = state["data"]
        if "stream" in data:  # written by an asynchronous run: stream cursor + untrained samples
            if self.ledger is not None:
                self.ledger.load_state_dict(data)
                # The staleness bound counts every group ever accepted: credit the ones trained
                # before the checkpoint (the untrained ones are regenerated and counted again).
                self.executor.staleness.credit_accepted(self.ledger.trained_groups)
            elif data["pending"]:
                raise ValueError(
                    f"the checkpoint holds {len(data['pending'])} untrained samples of an asynchronous run "
                    "(rollout.max_head_offpolicyness > 0): resume it with an online recipe"
                )
            else:
                self.train_stream.load_state_dict(data["stream"])
        else:
            self.train_stream.load_state_dict(data)
        self.version = int(state["version"]) - 1  # update_weights publishes them as that version
        self.update_weights()
        sampler = getattr(getattr(self, "rollout_engine", None), "sampler", None)
        if sampler is not None and "rollout_rng" in state:
            sampler.generator.set_state(state["rollout_rng"])

    def export_policy(self, path: Path) -> None:
        policy = self.runner.roles_to_sync()[0] if self.runner.roles_to_sync() else self.recipe.roles[0].name
        self.runner.backends[policy].export_hf(path)
        self.tokenizer.save_pretrained(path)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.stop()
        self.client.close()
        for backend in self.runner.backends.values():
            backend.shutdown()
        self.close_reward()

    def close_reward(self) -> None:
        """Stop this run's reward sandbox workers (a later run starts a fresh pool)."""
        if isinstance(getattr(self, "reward_fn", None), RewardSandbox):
            release_shared(self.reward_fn)  # closed once no other run of this process scores with it
        self.reward_fn = None
