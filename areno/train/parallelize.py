"""Turn a plain ``Decoder`` into a trainable, parallel one: TP, activation checkpointing, compile,
FSDP2 — in that fixed order (as torchtitan does), each step optional:

0. **Context parallelism** (``cp_size > 1``): the decoder's forward runs the layers on this rank's
   chunk of the packed stream, attention by Ulysses all-to-all (``areno.train.context_parallel``).
   **Expert parallelism** (mixture-of-experts models, ``ep_size > 1``) before all: the experts
   become DTensor shards over EP groups of ep_size FSDP shard ranks (replicated over the groups when
   ep_size < the shard size) with an all-to-all dispatch (``areno.train.expert_parallel``), and
   FSDP leaves them alone.
1. **Tensor parallelism** first, on the "tp" mesh dimension, with the model's own plan
   (``areno.models.tp_plan``): it turns weights into DTensors sharded over TP ranks, which FSDP2
   then shards again over the data-parallel dimensions (2-D FSDP x TP).
2. **Activation checkpointing** per decoder layer: recompute the layer in backward. The layer's
   ``forward`` is wrapped in place instead of wrapping the module, so parameter names (and thus
   checkpoints and policy sync) are the same with and without it.
3. **torch.compile** per decoder layer (``Module.compile`` compiles in place, names unchanged);
   per layer rather than whole-model so FSDP's per-layer hooks stay outside the graph (dynamo skips
   FSDP2's hooks). All layers share one graph (their code is the same; parameters are graph
   inputs), so compile time does not grow with depth. ``compile_scope="model"`` compiles the
   whole layer stack as one graph instead (fewer host calls per micro-batch; measured with one
   FSDP group or none, and equal to eager under per-layer FSDP groups too). The backend also runs every forward inside
   ``compiled_logprob_kernels()`` (fused element-wise kernels of the chunked log-prob head).
4. **FSDP2** (``fully_shard``) per decoder layer, then the root (embeddings, final norm, LM head).
   Mixed precision: parameters are all-gathered in ``param_dtype`` for compute while the sharded
   master weights, gradients reductions and optimizer state stay in the master dtype (fp32).
   The root keeps its parameters unsharded after forward (FSDP2's default for the root), so the
   LM head / tied embedding can be used outside ``forward`` by the chunked log-prob code.
   On a mesh of one rank the whole model is one FSDP group instead: per-layer
   groups exist to overlap each layer's gathers / reductions with compute and to free a layer's
   gathered weights early, neither of which one rank has, while every layer's hooks (gather,
   input casts, post-backward accumulation, reduction) cost host time per micro-batch. Numerics
   are the same (a one-rank gather is the ``param_dtype`` cast, its reduction the identity).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

import areno.train.vocab_parallel  # noqa: F401  (routes DTensor LM heads to the vocab-parallel log-probs)
from areno.errors import ConfigError
from areno.models import compiled
from areno.models.moe import sparse_blocks
from areno.models.tp_plan import COLWISE, ROWWISE, check_tp_norms, tp_plan, tp_style
from areno.models.vision import vision_towers
from areno.train.config import COMPILE_SCOPES, TrainBackendConfig
from areno.train.context_parallel import apply_context_parallel
from areno.train.expert_parallel import expert_mesh, shard_experts


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model``, or of the decoder inside a wrapper (a value or score head)."""
    return list(_decoder(model, "per-layer checkpointing, compile and FSDP").model.layers)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, vocab_parallel: bool = True) -> None:
    """Shard the linear layers the model's plan marks colwise/rowwise over ``tp_mesh``.

    Between blocks activations are replicated over TP ranks (no sequence parallelism): q/k/v and
    gate/up compute their own heads / columns, o_proj and down_proj all-reduce. Norms and the
    embedding stay replicated plain tensors, as in the plan. An untied LM head is sharded over the
    vocabulary when ``vocab_parallel`` (the plan's colwise): the log-prob code reads the output
    projection directly, and ``areno.train.vocab_parallel`` computes the log-softmax with a
    distributed log-sum-exp over the shards. A tied head is the (replicated) embedding. Inside a
    wrapper (a value or score head) the plan, written in the decoder's names, applies to the decoder;
    the wrapper's own head stays replicated, as are the hidden states it reads.
    """
    # slow to import (DTensor pulls in sympy): only a tensor-parallel run needs it
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = model.config
    tp = tp_mesh.size()
    if vision_towers(model):
        # the plan covers the decoder only; a replicated tower beside a sharded decoder is untested
        raise ConfigError(f"train tp_size={tp}: vision-language models train without tensor parallelism; set tp 1")
    try:
        check_tp_norms(cfg, tp)
    except ValueError as e:
        raise ConfigError(f"train {e}") from None
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % tp != 0:
            raise ValueError(f"tp_size={tp} does not divide {name}={getattr(cfg, name)}; pick a divisor of it")
    plan = tp_plan(cfg)
    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    decoder = _decoder(model, "tensor parallelism")
    module_plan = {}
    for name, module in decoder.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            style = tp_style(plan, f"{name}.weight")
            if style in styles:
                module_plan[name] = styles[style]()
    if vocab_parallel and not cfg.tie_word_embeddings:
        # Only the weight's layout matters: the log-prob code reads it, lm_head.forward never runs.
        module_plan["lm_head"] = ColwiseParallel(use_local_output=False)
    parallelize_module(decoder, tp_mesh, module_plan)


def apply_activation_checkpointing(model: nn.Module) -> None:
    for layer in _layers(model):
        layer.forward = _checkpointed(layer.forward)


def _decoder(model: nn.Module, needs: str) -> nn.Module:
    """The module that owns ``forward_layers`` (the model itself, or the decoder inside a wrapper
    such as a value head or LoRA)."""
    for module in model.modules():
        if callable(getattr(type(module), "forward_layers", None)):
            return module
    raise ValueError(f"{needs} needs an areno Decoder inside {type(model).__name__}")


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", scope: str = "layers", device_type: str = "cpu"
) -> None:
    """Compile in place. ``scope="layers"``: each decoder layer (one graph shared by all layers,
    so compile time does not grow with depth). ``scope="model"``: the whole layer stack and the
    final norm as one graph (``Decoder.forward_layers``): one compiled call per forward and one
    autograd node per backward instead of one per layer (host time per micro-batch), and fusion
    across layer boundaries; compile time grows with depth. Names and parameters are unchanged
    either way. ``dynamic=None``: the first graph is specialised to the first micro-batch's token
    count (fixed-size packed micro-batches keep it), and the first different count recompiles
    once with a symbolic one. On CUDA (``device_type``) dynamo's recompile limit is raised for the process
    (``compiled.allow_kinds``); on CPU the padded attention's layout, read per micro-batch, would recompile for each
    new layout, and eager past dynamo's default limit costs less there."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    if device_type == "cuda":
        compiled.allow_kinds()
    if scope == "model":
        decoder = _decoder(model, "compile_scope='model'")
        # an instance attribute shadows the method: Decoder.forward calls the compiled stack
        decoder.forward_layers = torch.compile(decoder.forward_layers, dynamic=None, backend=backend)
        return
    for layer in _layers(model):
        layer.compile(dynamic=None, backend=backend)


COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """Where inductor keeps what it compiled (FX graph and autograd caches, generated kernels):
    ``TORCHINDUCTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/areno/inductor`` (default
    ``~/.cache/areno/inductor``), exported to this process and its children. torch's own default
    lives under the temporary directory, which a reboot or a fresh container empties, so the next
    run would compile again."""
    path = os.environ.get(COMPILE_CACHE_ENV)
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "areno", "inductor")
        os.environ[COMPILE_CACHE_ENV] = path
    return Path(path)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    sharded: bool = True,
    one_group: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """``sharded=False`` (one shard: one rank or pure replication): nothing is gathered from peers,
    so layers keep their compute-dtype copy from forward to backward instead of casting it again
    (memory: one compute-dtype copy of the weights; the backend also keeps it across the step's
    micro-batches and frees it after the last backward, before the optimizer updates the master).
    ``one_group``: no per-layer groups, the root holds every parameter (for a mesh of one rank).
    ``ignored_params``: parameters FSDP leaves alone (expert-parallel shards)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # slow to import: only a sharded run

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in model.float32_modules() if hasattr(model, "float32_modules") else ():  # a value or score head
        fully_shard(module, mesh=dp_mesh, mp_policy=fp32, reshard_after_forward=sharded)
    if not one_group:
        for layer in _layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=sharded, ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored_params)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    cfg: TrainBackendConfig,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    cp_group: dist.ProcessGroup | None = None,
    device_type: str = "cpu",
) -> nn.Module:
    """Apply expert parallelism (``cfg.ep_size``), TP, activation checkpointing, compile and FSDP2
    in that order; returns ``model``.

    ``mesh``: None for one process (checkpointing and compile only), else a mesh with dimensions
    ("dp_replicate", "dp_shard", "tp"); FSDP shards over dp_shard and replicates over
    dp_replicate (HSDP when that is > 1); a mesh of one rank gets one FSDP group for the whole model.
    ``cp_group``: this rank's context-parallel group when ``cfg.cp_size`` > 1 (the FSDP backend makes it).
    ``device_type``: where the model trains (``apply_compile``'s).
    """
    if cfg.cp_size > 1:
        if cp_group is None or mesh is None:
            raise ConfigError(f"cp_size={cfg.cp_size} needs the FSDP2 backend (torchrun or a partitioned run)")
        apply_context_parallel(model, cp_group, cfg.cp_size, tp_size=mesh["tp"].size(), ep_size=cfg.ep_size)
    experts = apply_expert_parallel(model, mesh, cfg.ep_size) if cfg.ep_size > 1 else None
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], vocab_parallel=cfg.tp_vocab_parallel)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model, scope=cfg.compile_scope, device_type=device_type)
    if mesh is not None:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            sharded=mesh["dp_shard"].size() > 1,
            one_group=mesh.size() == 1,
            ignored_params=experts,
        )
    return model


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh | None, ep_size: int) -> set[nn.Parameter]:
    """Split the experts over EP groups of the FSDP shard dimension (``expert_parallel.shard_experts``),
    before FSDP, which then leaves them alone. ``ep_size`` == the shard size: one EP group (the
    shard dimension's own mesh); smaller: a 2-D mesh ("ep_replicate", "ep") whose replicas sum the
    experts' gradients (``expert_parallel.expert_mesh``). Either way the expert gradients take the
    1/dp of FSDP's average. Returns the expert parameters. One-line ``ConfigError`` for a layout
    expert parallelism does not cover."""
    blocks = sparse_blocks(model)
    num_experts = blocks[0].num_experts if blocks else 0
    if not num_experts or num_experts % ep_size:
        raise ConfigError(
            f"ep_size={ep_size} must divide the model's expert count ({num_experts or 'a dense model has none'}): "
            f"{'leave out the e of cluster.allocation_mode' if not num_experts else 'pick a divisor of it'}"
        )
    if mesh is None or mesh["dp_shard"].size() % ep_size or mesh["dp_replicate"].size() > 1 or mesh["tp"].size() > 1:
        shape = "one process" if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
        raise ConfigError(
            f"ep_size={ep_size} needs the FSDP2 backend with a shard dimension that {ep_size} divides, no replication "
            f"and tp 1 (got {shape}): make the data-parallel size a multiple of the expert-parallel size"
        )
    shard = mesh["dp_shard"]
    if shard.size() == ep_size:
        ep_mesh = shard
    else:
        ep_mesh = expert_mesh(mesh.mesh.reshape(-1).tolist(), ep_size, mesh.device_type)
    return set(shard_experts(model, ep_mesh, grad_scale=1.0 / shard.size()))
