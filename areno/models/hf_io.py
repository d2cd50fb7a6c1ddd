"""Hugging Face checkpoint I/O: ``config.json`` + ``*.safetensors`` (single or sharded) <-> ``Decoder``.

Tensor names need no mapping for dense models: ``Decoder`` module names equal the HF names. Expert
models hold their experts fused ([E, ...] tensors, transformers 5's in-memory layout); their
checkpoints store one tensor per expert (what transformers saves; GraniteMoE's keep them fused under
names of their own), which ``moe.disk_to_memory`` maps in loading and ``moe.to_disk_state`` in saving.
``save_model`` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from areno.errors import ConfigError, ModelDirError, is_of_type, wrong_type
from areno.models import gpt_oss, moe, packed_projections, vl_text
from areno.models.config import GLM4_MOE, GPT_OSS, SEQUENCE_CLASSIFIER_SUFFIX, SUPPORTED_ARCHITECTURES, ModelConfig
from areno.models.decoder import Decoder
from areno.models.tp_plan import TPReduce, shard_dim, tp_plan, tp_style
from areno.models.vision import VisionConfig, VisionLanguageModel, processor_config, read_pixel_limits

log = logging.getLogger(__name__)

# Non-parameter tensors that some HF checkpoints carry and we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def beyond_layers(config: ModelConfig, name: str) -> bool:
    """Whether ``name`` is a tensor of a layer at or past ``num_hidden_layers`` that transformers' class skips on
    load: GLM-4.5's multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.46.*`` of
    GLM-4.5-Air, ``model.layers.92.*`` of GLM-4.5 and GLM-4.6), which areno neither trains nor saves."""
    if config.architecture != GLM4_MOE or not name.startswith("model.layers."):
        return False
    return int(name.split(".", 3)[2]) >= config.num_hidden_layers


def log_skipped_layers(config: ModelConfig, names: list[str], where: str | Path) -> None:
    """One log line for the ``beyond_layers`` tensors a read of ``where`` left out."""
    if names:
        log.info(
            "%s: skipped %d tensors of layers >= num_hidden_layers=%d (the multi-token-prediction layers of %s, "
            "which areno neither trains nor saves)",
            where,
            len(names),
            config.num_hidden_layers,
            config.architecture,
        )


_TINY_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "granite": "GraniteForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_TINY_NORM_LAYOUTS = {
    "olmo2": "post",
    "olmo3": "post",
    "exaone4": "post",
    "gemma2": "sandwich",
    "gemma3": "sandwich",
    "glm4": "sandwich",
}
"""``ModelConfig.norm_layout`` of the tiny archs not in the pre-norm layout."""


def missing_model_dir(key: str, path: Path) -> str:
    """The message of a checkpoint directory that does not exist; a path that reads as a Hugging Face Hub
    id from here (``Qwen/Qwen2.5-0.5B-Instruct``) says how to fetch it, since areno downloads nothing."""
    rel = Path(os.path.relpath(path))
    if len(rel.parts) == 2 and rel.parts[0] != ".." and not Path(rel.parts[0]).exists():
        return (
            f"{key}: directory {path} does not exist: point it at a local Hugging Face checkpoint (if "
            f"{rel.as_posix()} is a Hugging Face Hub id: areno downloads nothing; `hf download {rel.as_posix()} "
            f"--local-dir DIR`, then {key}=DIR)"
        )
    return f"{key}: directory {path} does not exist: point it at a local Hugging Face checkpoint"


def read_config(model_dir: str | Path, *, key: str = "model.path") -> ModelConfig:
    """``ModelConfig`` from ``model_dir/config.json``; a missing directory or file, a corrupt file or
    a model this decoder does not implement is a one-line :class:`ModelDirError` naming the path
    (and ``key``, what the user set it with)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(missing_model_dir(key, model_dir))
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        if any(model_dir.glob("*.gguf")):
            raise ModelDirError(
                f"{model_dir} holds GGUF files (llama.cpp's format), which areno does not read: point {key} at the "
                "model's Hugging Face checkpoint (config.json, *.safetensors, the tokenizer files)"
            )
        raise ModelDirError(
            f"{key}: {config_path} not found: point {key} at a Hugging Face checkpoint directory (config.json, "
            "*.safetensors and the tokenizer files)"
        )
    try:
        d = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{config_path} is not valid JSON ({e}): re-export or re-download the checkpoint") from None
    if not isinstance(d, dict):
        raise ModelDirError(f"{config_path} holds a JSON {type(d).__name__}, not a Hugging Face config object")
    try:
        config = ModelConfig.from_hf(d)
        processor = model_dir / "preprocessor_config.json"
        if config.vision is not None and processor.is_file():  # the image processor's pixel limits
            limits = read_pixel_limits(json.loads(processor.read_text(encoding="utf-8")))
            config = config.replace(vision={**config.vision, **limits})
        if config.container is not None:  # where a save finds the vision tower it does not hold
            config = config.replace(container={**config.container, "source": str(model_dir.resolve())})
        return config
    except KeyError as e:
        raise ModelDirError(f"{config_path} has no {e.args[0]!r}: is it the config.json of a decoder LLM?") from None
    except ValueError as e:  # an architecture or feature this decoder does not implement
        raise ModelDirError(f"{config_path}: {e}") from None


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a Hugging Face model directory: those ``model.safetensors.index.json``
    lists when it exists (every one must be there), else every ``*.safetensors`` in it.
    One-line :class:`ModelDirError` naming the path otherwise."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelDirError(
                f"{index} is not a safetensors index (needs a 'weight_map' of tensor -> file; "
                f"{type(e).__name__}: {e}): re-export the checkpoint or delete the stray index"
            ) from None
        if not names or not all(isinstance(n, str) for n in names):
            raise ModelDirError(f"{index} has an empty or malformed 'weight_map': re-export the checkpoint")
        files = sorted(model_dir / n for n in names)
        for f in files:
            if not f.is_file():
                raise ModelDirError(
                    f"{f} is listed in {index} but does not exist: copy the missing shard or re-export the checkpoint"
                )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files and any(model_dir.glob("pytorch_model*.bin")):
        raise ModelDirError(
            f"{model_dir} holds pytorch_model*.bin weights only, which areno does not read (pickles): convert them "
            "once with transformers, AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
            "safe_serialization=True)"
        )
    if not files:
        raise ModelDirError(f"no *.safetensors files in {model_dir}: a model directory needs its weights")
    return files


@contextmanager
def open_safetensors(
    path: str | Path, *, fix: str = "re-export the checkpoint, or point model.path at a complete one"
) -> Iterator[Any]:
    """``safe_open(path)`` on the CPU; a truncated or corrupt file, found on opening or while reading
    in the ``with`` body, raises a one-line :class:`ModelDirError` naming it, ending with ``fix``."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        raise ModelDirError(f"{path} is truncated or not a safetensors file ({reason}): {fix}") from None


class _MetaShortcuts(TorchFunctionMode):
    """Building a module on the meta device and materialising it without the ops torch runs there
    through Python references that import torch._dynamo and sympy (slow imports that would come
    before the first rollout token): random initialisers are skipped (every value is loaded
    afterwards) and ``empty_like`` to a real device becomes ``empty_strided`` of the same layout."""

    OPS = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.nn.init.normal_,
            torch.nn.init.uniform_,
            torch.nn.init.kaiming_uniform_,
            torch.nn.init.trunc_normal_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            return args[0] if args else kwargs["tensor"]
        if func is torch.empty_like and args[0].is_meta and set(kwargs) == {"device"}:
            t = args[0]
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=kwargs["device"])
        return func(*args, **kwargs)


def build_model(config: ModelConfig, **kw: Any) -> Decoder:
    """The module ``config`` describes: ``VisionLanguageModel`` for a Qwen2.5-VL config, else ``Decoder``."""
    return (VisionLanguageModel if config.vision is not None else Decoder)(config, **kw)


def meta_model(config: ModelConfig) -> Decoder:
    """The module ``config`` describes on the meta device, without memory or initialisation: to check its
    structure (LoRA's targets) before any weights load."""
    with _MetaShortcuts(), torch.device("meta"):
        return build_model(config)


SCORE_HEAD_KEYS = ("score.weight", "score.bias")
"""The scalar head of transformers' ``*ForSequenceClassification`` checkpoints."""


def is_sequence_classifier(model_dir: str | Path) -> bool:
    """Whether ``model_dir/config.json`` names a ``*ForSequenceClassification`` architecture."""
    d = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return any(a.endswith(SEQUENCE_CLASSIFIER_SUFFIX) for a in d.get("architectures") or [])


def read_score_head(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The ``score.weight`` (and ``score.bias`` where stored) tensors of ``model_dir``'s
    safetensors; {} when the checkpoint has no score head (a causal LM)."""
    out = {}
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():
                if name in SCORE_HEAD_KEYS:
                    out[name] = f.get_tensor(name)
    return out


def stop_token_ids(model_dir: str | Path, model_config: ModelConfig, tokenizer: Any = None) -> tuple[int, ...]:
    """Every id that ends a generation, as transformers' ``generate`` and vLLM stop on them: config.json's
    ``eos_token_id`` (one or a list), generation_config.json's, then the tokenizer's (Qwen2.5's
    ``<|endoftext|>`` and Llama 3's ``<|eom_id|>`` are in the files' lists only)."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(model_config.eos_token_id)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelDirError(f"{gen_path} is not valid JSON ({exc}): fix or delete it") from None
        if isinstance(gen, dict):
            add(gen.get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_reduce: TPReduce | None = None,
) -> tuple[Decoder, ModelConfig]:
    """Build the decoder described by ``model_dir/config.json`` and load its safetensors weights.

    With ``tp_size > 1`` only this rank's shards (``tp_plan``) are read and the decoder calls
    ``tp_reduce`` after its row-parallel projections (see ``Decoder``).
    Raises a one-line error naming the path for a missing directory/config/weights, and naming the
    first tensor that is missing, unexpected, or of the wrong shape.
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    if config.vision is not None and tp_size > 1:
        raise ModelDirError(f"{model_dir}: a vision-language model loads whole (tp_size=1), not as tp_size={tp_size}")
    with _MetaShortcuts():
        with torch.device("meta"):
            model = build_model(config, tp_size=tp_size, tp_reduce=tp_reduce).to(dtype)
            moe.keep_routers_float32(model)  # GLM-4.5's, as transformers keeps them
        model.to_empty(device=device)
    expected = model.state_dict()
    plan = tp_plan(config)
    experts = moe.disk_to_memory(config)  # per-expert names on disk -> slices of fused tensors
    packed = packed_projections.packed_names(config)  # Phi-3's qkv_proj / gate_up_proj -> their parts
    seen: set[str] = set()
    stored_head = None
    classifier = is_sequence_classifier(model_dir)
    if classifier and "lm_head.weight" in expected:  # a scalar-head checkpoint stores no LM head
        with torch.no_grad():
            expected["lm_head.weight"].zero_()
        seen.add("lm_head.weight")
    oss = gpt_oss.HeldTensors() if config.architecture == GPT_OSS else None
    skipped: list[str] = []
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for disk_name in f.keys():
                name = disk_name if config.container is None else vl_text.text_name(config.container, disk_name)
                if name is None or name.endswith(_IGNORED_SUFFIXES) or (classifier and name in SCORE_HEAD_KEYS):
                    continue
                if beyond_layers(config, name):
                    skipped.append(name)
                    continue
                if oss is not None and gpt_oss.is_disk_name(name):  # renamed, laid out as held, dequantized
                    for held, tensor in oss.held(name, f.get_tensor(disk_name)):
                        if held not in expected:
                            raise ModelDirError(f"unexpected tensor {disk_name!r} in {path} for {config.architecture}")
                        _rank_index(held, tuple(tensor.shape), expected[held], plan, tp_rank, tp_size, path)
                        with torch.no_grad():
                            expected[held].copy_(tensor)
                        seen.add(held)
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    # some tied checkpoints store the duplicate; the embedding is the source (checked below)
                    stored_head = (f.get_tensor(disk_name), path) if tp_size == 1 else None
                    continue
                if name in experts:
                    _load_expert_part(f, path, disk_name, experts[name], expected)
                    seen.add(name)
                    continue
                if name in packed:
                    for part, tensor in _split_packed(path, name, f.get_tensor(disk_name), packed[name]):
                        index = _rank_index(part, tuple(tensor.shape), expected[part], plan, tp_rank, tp_size, path)
                        with torch.no_grad():
                            expected[part].copy_(tensor if index is None else tensor[index])
                        seen.add(part)
                    seen.add(name)
                    continue
                if name not in expected:
                    raise ModelDirError(
                        f"unexpected tensor {disk_name!r} in {path} for {config.architecture} "
                        f"(the checkpoint does not match config.json)"
                    )
                target = expected[name]
                if vl_text.fused_experts(config.container):  # its experts may be stored transposed
                    tensor = vl_text.as_held(config.container, name, f.get_tensor(disk_name), tuple(target.shape))
                    _rank_index(name, tuple(tensor.shape), target, plan, tp_rank, tp_size, path)  # shape check
                    with torch.no_grad():
                        target.copy_(tensor)
                    seen.add(name)
                    continue
                index = _rank_index(
                    name, tuple(f.get_slice(disk_name).get_shape()), target, plan, tp_rank, tp_size, path
                )
                tensor = (
                    f.get_tensor(disk_name) if index is None else f.get_slice(disk_name)[index]
                )  # only this rank's rows
                with torch.no_grad():
                    target.copy_(tensor)
                seen.add(name)
    log_skipped_layers(config, skipped, model_dir)
    if oss is not None and oss.unpaired():
        raise ModelDirError(f"{model_dir}: MXFP4 tensor {oss.unpaired()[0]!r} is stored without its other half")
    if stored_head is not None:
        head, path = stored_head
        embedding = next(t for n, t in expected.items() if n.endswith("embed_tokens.weight"))
        if head.shape != embedding.shape or not torch.equal(head.to(embedding), embedding):
            # transformers unties them and uses the stored head: tying would compute another model
            raise ModelDirError(
                f"{model_dir}/config.json says tie_word_embeddings=true but {path} stores an lm_head.weight that "
                "differs from the embedding: set tie_word_embeddings to false in config.json"
            )
    # a fused expert tensor is complete when stored whole or as all of its per-expert parts
    parts: dict[str, list[str]] = {}
    for disk, (mem, _, _) in experts.items():
        parts.setdefault(mem, []).append(disk)
    for disk, members in packed.items():  # a packed tensor's parts are missing under its own name
        for mem, _ in members:
            parts[mem] = [disk]
    missing = [p for n in expected if n not in seen for p in parts.get(n, [n]) if p not in seen]
    if missing:
        first = missing[0] if config.container is None else vl_text.disk_name(config.container, missing[0])
        raise ModelDirError(
            f"tensor {first!r} is missing from the checkpoint in {model_dir} ({len(missing)} missing in all)"
        )
    model.eval()
    return model, config


def _split_packed(path: Path, name: str, tensor: torch.Tensor, parts: list[tuple[str, int]]):
    """``packed_projections.split_packed`` with a row count that does not add up named with its file."""
    try:
        return packed_projections.split_packed(parts, tensor)
    except ValueError as e:
        raise ModelDirError(f"tensor {name!r} in {path}: {e}") from None


def _rank_index(
    name: str,
    full_shape: tuple[int, ...],
    target: torch.Tensor,
    plan: dict[str, str],
    tp_rank: int,
    tp_size: int,
    path: Path,
) -> tuple[slice, ...] | None:
    """The index of this rank's part of a full tensor stored under ``name`` (None: all of it), after
    checking its shape against what config.json implies (a one-line ``ModelDirError`` naming both)."""
    want = list(target.shape)
    dim = shard_dim(tp_style(plan, name)) if tp_size > 1 else None
    if dim is not None and dim < len(want):
        want[dim] *= tp_size
    if full_shape != tuple(want):
        raise ModelDirError(f"tensor {name!r} in {path} has shape {full_shape}, config.json implies {tuple(want)}")
    if dim is None or dim >= len(want):
        return None
    n = target.shape[dim]
    return (slice(None),) * dim + (slice(tp_rank * n, (tp_rank + 1) * n),)


def _load_expert_part(
    f: Any, path: Path, name: str, where: tuple[str, int, slice], expected: dict[str, torch.Tensor]
) -> None:
    """Copy one on-disk expert (or router) tensor into its slice of the fused in-memory tensor."""
    fused, expert, rows = where
    target = expected[fused] if expert < 0 else expected[fused][expert, rows]
    shape = tuple(f.get_slice(name).get_shape())
    if shape != tuple(target.shape):
        raise ModelDirError(f"tensor {name!r} in {path} has shape {shape}, config.json implies {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(f.get_tensor(name))


def save_model(model: Decoder, config: ModelConfig, out_dir: str | Path, *, tokenizer: Any | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` (HF names), and
    the tokenizer if given. ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it."""
    if model.tp_size > 1:
        raise ValueError(f"save_model needs the full model; this Decoder holds a tp_size={model.tp_size} shard")
    return save_state(model.state_dict(), config, out_dir, tokenizer=tokenizer)


def checkpoint_names(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's names) under the names a checkpoint of ``config`` stores: experts one by one
    (``moe.to_disk_state``) unless the checkpoint keeps them fused as held, and a vision-language checkpoint's
    text model under its prefix (``vl_text``). Each tensor is an input or a contiguous slice of one
    (``CheckpointNamedSource`` plans on that); projections stay separate."""
    if config.architecture == GPT_OSS:
        state = gpt_oss.to_disk_state(state)
    elif not vl_text.fused_experts(config.container):
        state = moe.to_disk_state(config, state)
    return vl_text.to_disk_state(config.container, state)


def save_state(
    state: dict[str, torch.Tensor], config: ModelConfig, out_dir: str | Path, *, tokenizer: Any | None = None
) -> Path:
    """``save_model`` of a full state dict under the Decoder's (HF) names, without a Decoder to hold it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    state = checkpoint_names(config, packed_projections.to_disk_state(config, state))
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf = config.to_hf()
    hf["torch_dtype"] = dtype
    for part in (hf, hf.get("text_config") or {}):  # transformers 5's key, where the file has it
        if "dtype" in part:
            part["dtype"] = dtype
    if config.container is not None:  # the vision tower and projector as they came, read before any write
        state.update(_kept_apart(config.container, into=out_dir))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _drop_stale_shards(out_dir)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    gen = {k: list(v) if isinstance(v, tuple) else v for k, v in ids.items() if v is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if config.vision is not None:
        processor = processor_config(VisionConfig.from_hf(config.vision))
        (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    if config.container is not None:  # the image processor's files, which transformers' processor reads
        source = Path(config.container["source"])
        for name in vl_text.PROCESSOR_FILES:
            if (source / name).is_file() and not (out_dir / name).exists():
                (out_dir / name).write_bytes((source / name).read_bytes())
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _drop_stale_shards(out_dir: Path) -> None:
    """An earlier sharded checkpoint's index and shards in ``out_dir``: the index would send every reader to
    the old shards instead of the ``model.safetensors`` just written beside them."""
    index = out_dir / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        shards = set()  # a malformed index: removed all the same, its shards left where they are
    for name in shards - {"model.safetensors"}:
        if isinstance(name, str) and "/" not in name:
            (out_dir / name).unlink(missing_ok=True)
    index.unlink()


def _kept_apart(container: dict[str, Any], *, into: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``container``'s checkpoint its text model does not hold (``vl_text.other_name``),
    under the names a save writes; a one-line ``ModelDirError`` where that checkpoint is gone. Read into
    memory where the save goes ``into`` that checkpoint's own directory (else they stay mapped from it)."""
    arch, source = container["architecture"], container.get("source")
    fix = "point the save at a model read from that directory (hf_io.read_config / load_model)"
    if source is None:
        raise ModelDirError(
            f"saving a {arch} text model needs the checkpoint it came from, for its vision tower: {fix}"
        )
    try:
        files = safetensors_files(source)
    except ModelDirError as e:
        raise ModelDirError(
            f"saving a {arch} text model copies the vision tower from {source}, which is no longer readable ({e}): "
            "restore that checkpoint directory"
        ) from None
    same_dir = into.resolve() == Path(source).resolve()  # the file written over is the one read
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with open_safetensors(path) as f:
            for disk in f.keys():
                name = vl_text.other_name(container, disk)
                if name is not None:
                    out[name] = f.get_tensor(disk).clone() if same_dir else f.get_tensor(disk)
    if not out:
        raise ModelDirError(
            f"{source} holds no vision tower or projector tensors for its {arch} config.json: point model.path at the "
            "whole vision-language checkpoint"
        )
    return out


def init_model_dir(
    out_dir: str | Path,
    config: ModelConfig,
    tokenizer: Any,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Path:
    """A randomly initialised checkpoint (model + tokenizer + generation config) in ``out_dir``.

    Token ids left None in ``config`` are taken from the tokenizer. ``device``: where the weights are
    drawn (a GPU draws a 7B model in seconds where a CPU takes minutes; the draws differ by device);
    ``dtype``: the stored dtype (None: float32).
    """
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size is {config.vocab_size}")
    fill = {}
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, field) is None and getattr(tokenizer, field, None) is not None:
            fill[field] = getattr(tokenizer, field)
    config = config.replace(**fill) if fill else config
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with device:
            model = build_model(config)
    if dtype is not None:
        model.to(dtype)
        moe.keep_routers_float32(model)  # GLM-4.5's in float32 (their random draws rounded once: no matter)
    return save_model(model, config, out_dir, tokenizer=tokenizer)


_TINY_ARGUMENTS = {"arch": str, "hidden_size": int, "layers": int, "heads": int, "kv_heads": int}
"""``tiny_config``'s own arguments; any ``ModelConfig`` field but ``vocab_size`` may be given besides."""


def check_tiny_arguments(arguments: dict[str, Any], *, key: str = "tiny_config") -> None:
    """A one-line ``ConfigError`` naming ``<key>.<name>`` for an argument of ``tiny_config`` it does
    not take (with the closest one and every valid one) or of another type than it takes: the
    ``model.init_tiny`` mapping checked before a shape computation meets a string."""
    hints = typing.get_type_hints(ModelConfig)
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.init and f.name != "vocab_size"]
    types = {**_TINY_ARGUMENTS, **{name: hints[name] for name in fields}}
    for name, value in arguments.items():
        if name == "vocab_size":
            raise ConfigError(f"{key}.vocab_size: the model's vocabulary is the tokenizer's: leave vocab_size out")
        if name not in types:
            # tiny_config's own arguments first: "hidden" means hidden_size more often than hidden_act
            close = difflib.get_close_matches(name, list(_TINY_ARGUMENTS), n=1) or difflib.get_close_matches(
                name, list(types), n=1
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: unknown key {name!r}{hint}; valid keys: {', '.join(types)}")
        if not is_of_type(value, types[name]):
            raise wrong_type(f"{key}.{name}", types[name], value)


def tiny_config(
    vocab_size: int,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    **kw: Any,
) -> ModelConfig:
    """A small ``ModelConfig`` of the given family for tests and demos.

    ``arch``: llama, qwen2, qwen3, mistral, olmo2, olmo3 or gemma3 (a 16-token window in every layer but the
    last; gemma3's turning at base 1,000 there), gemma2 (a 16-token window in every other layer from the first,
    attention scores soft-capped at 5 and logits at 5, so that the caps act on a tiny model), phi3, glm4 (half of each head turned, by adjacent pairs),
    ernie4_5 (biases on every projection, tied embeddings, whole heads turned by adjacent pairs in float32),
    exaone4 (per-head q/k norms, norms after each block, a 16-token window in every layer but the last, which
    alone turns by no RoPE),
    ministral3 (queries scaled by position every 8 positions), granite (Llama's layers with Granite's
    multipliers as its released models set them: embeddings times 12, scores scaled by 1 / head_dim, block outputs
    times 0.22, logits divided by 8), smollm3 (no RoPE in layers 3, 7, ...), qwen3_moe,
    mixtral (4 experts, top-2, each half the dense MLP's width), gpt_oss (those experts with biases and the
    clamped SwiGLU, attention biases and sinks, a 16-token window in every other layer from the first), glm4_moe
    (GLM-4.5: a dense first layer, then 8 experts in 4 groups, top-2 from the best 2 groups by a sigmoid router
    scaled by 2.5, a shared expert, q/k/v biases and per-head q/k norms, half of each head turned by rotate-half
    RoPE), qwen2_moe (qwen3_moe's experts without q/k norms, with q/k/v biases and a gated shared expert of the
    hidden size's width), granitemoe (granite's multipliers around an expert block in every layer, 4 experts,
    top-2, one width) or olmoe (Llama's layers with q/k norms over the whole projections, 4 experts of
    hidden_size's width, top-2, not renormalised; no clamp of q, k and v unless ``clip_qkv`` is given). ``kw``
    overrides any other ModelConfig field (e.g. ``tie_word_embeddings=True``, ``rope_scaling={...}``). Token ids
    default to the char tokenizer's (pad 0, bos 1, eos 2).
    """
    check_tiny_arguments(
        {"arch": arch, "hidden_size": hidden_size, "layers": layers, "heads": heads, "kv_heads": kv_heads, **kw}
    )
    if arch not in _TINY_ARCHS:
        raise ValueError(f"tiny_config arch must be one of {sorted(_TINY_ARCHS)}, got {arch!r}")
    architecture = _TINY_ARCHS[arch]
    qkv_bias = arch in ("qwen2", "gpt_oss", "glm4", "glm4_moe", "qwen2_moe")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=2048,
        attention_bias=qkv_bias,
        attention_out_bias=arch == "gpt_oss",
        qk_norm=arch in ("qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3", "exaone4", "glm4_moe", "olmoe"),
        qk_norm_scope="projection" if arch in ("olmo2", "olmo3", "olmoe") else "head",
        norm_layout=_TINY_NORM_LAYOUTS.get(arch, "pre"),
        architecture=architecture,
        model_type=SUPPORTED_ARCHITECTURES[architecture],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch in ("olmo3", "gemma3", "exaone4"):  # a short window, in every layer but the last (OLMo 3: three of four)
        fields.update(sliding_window=16, window_layers=tuple(range(layers - 1)) if layers > 1 else None)
    if arch in ("gemma2", "gemma3"):
        fields.update(norm_weight_offset=1.0, hidden_act="gelu_pytorch_tanh", scale_embeddings=True)
        fields.update(query_pre_attn_scalar=float(hidden_size // heads), tie_word_embeddings=True)
    if arch == "gemma2":  # every other layer windowed; caps small enough to bend a tiny model's scores and logits
        fields.update(sliding_window=16, window_layers=tuple(range(0, layers, 2)))
        fields.update(attn_logit_softcapping=5.0, final_logit_softcapping=5.0)
    if arch == "gemma3":  # its window layers turn at another base, as Gemma 3's local layers do
        if layers > 1:
            fields["window_rope"] = {"rope_theta": 1000.0}
    if arch == "ministral3":  # the query scale past a short period, so that short sequences reach it
        fields["query_position_scale"] = (0.1, 8)
    if arch == "glm4":  # half of each head turned, adjacent pairs together
        fields.update(partial_rotary_factor=0.5, rope_interleaved=True)
    if arch in ("granite", "granitemoe"):
        fields.update(embedding_multiplier=12.0, attention_multiplier=1.0 / (hidden_size // heads))
        fields.update(residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True)
    if arch == "ernie4_5":  # every projection biased (use_bias), so that every path carries the biases
        fields.update(rope_interleaved=True, rope_in_float32=True, tie_word_embeddings=True)
        fields.update(attention_bias=True, attention_out_bias=True, mlp_bias=True)
    if arch == "smollm3":
        fields["nope_layers"] = tuple(i for i in range(layers) if (i + 1) % 4 == 0)
    if arch in ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "granitemoe", "olmoe"):
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size)
        fields["norm_topk_prob"] = arch in ("mixtral", "gpt_oss", "granitemoe")
    if arch in ("gpt_oss", "granitemoe", "olmoe"):
        fields["intermediate_size"] = hidden_size  # one width, the experts' (config.json has no other)
    if arch == "gpt_oss":
        fields.update(attention_sinks=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
        fields.update(sliding_window=16, window_layers=tuple(range(0, layers, 2)))
        # transformers 5 gives every gpt-oss YaRN; over 64 original positions, short sequences pass them
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        fields["rope_scaling"] = {**yarn, "original_max_position_embeddings": 64}
    if arch == "glm4_moe":  # every routing rule at work: groups, the scale, a shared expert, a dense first layer
        fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2)
        fields.update(norm_topk_prob=True, router_scoring="sigmoid", n_group=4, topk_group=2)
        fields.update(routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5)
    if arch == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = hidden_size
    fields.update(kw)
    if arch == "exaone4" and "nope_layers" not in kw:  # where a window is set, the layers without one turn by none
        window, window_layers = fields.get("sliding_window"), fields.get("window_layers")
        full = [i for i in range(layers) if window_layers is not None and i not in window_layers]
        fields["nope_layers"] = tuple(full) if window is not None else ()
    if (
        arch in ("mixtral", "gpt_oss", "granitemoe", "olmoe")
        and "moe_intermediate_size" not in kw
        and "intermediate_size" in kw
    ):
        fields["moe_intermediate_size"] = kw["intermediate_size"]  # Mixtral's experts are intermediate_size wide
    return ModelConfig(**fields)
