"""Shared pieces of the rollout tests: tiny random decoders, random prompts, a naive greedy
reference, engines for the mixed-decode and fused-projection tests, a CPU emulation of the decode
graph runner, and a policy sync into an engine through its receiving end."""

from __future__ import annotations

import torch

from areno.models.decoder import Decoder
from areno.models.hf_io import tiny_config
from areno.rollout.cuda_graph import DecodeGraphRunner
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.sync.base import ShardSpec, engine_receiver
from areno.types import SamplingParams

VOCAB = 64
EOS = 2


def make_model(seed: int = 0, **kw) -> tuple[Decoder, object]:
    if kw.get("arch") == "smollm3":
        kw.setdefault("nope_layers", (1,))  # of the two layers: one rotated, one not
    cfg = tiny_config(VOCAB, hidden_size=32, layers=2, heads=4, kv_heads=2, max_position_embeddings=256, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(cfg)
        # A larger init spread makes the tiny model's argmax decisive (no near-ties in parity tests).
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3)
    return model.eval(), cfg


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
    return out


@torch.no_grad()
def naive_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Full recompute every token (no cache): the reference for the engine."""
    ids = list(prompt)
    logprobs = []
    for _ in range(n):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        logits = model.logits(hidden[-1:]).float()[0]
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], logprobs


GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, ignore_eos=True, seed=11)
ARCHS = [
    "qwen2",
    "llama",
    "olmo2",
    "olmo3",
    "gemma3",
    "smollm3",
    "glm4",
    "gemma2",
    "granite",
    "ernie4_5",
    "exaone4",
    "qwen2_moe",
]
"""q/k/v bias, no bias, q/k norms and post-block norms, a window in some layers only, GeGLU and norms
around each block, a NoPE layer, half of each head turned by adjacent pairs with norms around each block in
the model dtype, soft-capped attention scores and logits, scaled embeddings, scores, block outputs and logits,
whole heads turned by adjacent pairs in float32 with every projection biased, per-head q/k norms with post-block
norms in the model dtype and a NoPE full layer beside a window layer, a dense layer beside a sparse one whose
shared expert's gate/up fuse and pack as a dense MLP's."""


def model_of(arch: str, seed: int = 0) -> tuple[Decoder, object]:
    kw = {"nope_layers": (1,)} if arch == "smollm3" else {}  # one rotated layer, one not
    if arch == "qwen2_moe":  # layer 0 dense (the tests read its MLP), layer 1 sparse with the shared expert
        kw = {"mlp_only_layers": (0,)}
    cfg = tiny_config(
        VOCAB, arch=arch, hidden_size=32, layers=2, heads=4, kv_heads=2, max_position_embeddings=256, **kw
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(cfg)
        with torch.no_grad():  # decisive argmaxes; non-zero q/k/v biases (qwen2)
            for p in model.parameters():
                p.normal_(0.0, 0.3 if p.dim() == 2 else 0.1)
    return model.eval(), cfg


def run(engine: RolloutEngine, prompts, params=GREEDY):
    outs = engine.generate(prompts, params)
    return [o.output_ids for o in outs], [o.output_logprobs for o in outs]


def engine(model_cfg, decode_steps: int, *, graphs: bool = False, eos=(EOS,), tokenizer=None, **kw) -> RolloutEngine:
    model, cfg = model_cfg
    defaults = dict(
        block_size=4,
        num_blocks=160,
        max_num_seqs=8,
        max_tokens_per_step=48,
        prefill_chunk_size=8,
        max_model_len=80,
        mixed_decode_min_rows=1,
    )
    defaults.update(kw)
    eng = RolloutEngine(
        model,
        cfg,
        config=RolloutEngineConfig(decode_steps=decode_steps, **defaults),
        eos_token_ids=eos,
        tokenizer=tokenizer,
    )
    if graphs:
        eng._graphs = eager_runner(eng, max_batch=defaults["max_num_seqs"])
    return eng


def same(a, b):
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.output_versions for o in a] == [o.output_versions for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.output_logprobs, y.output_logprobs, rtol=0, atol=1e-5)


class _EagerReplay:
    """Stands in for a CUDA graph on CPU: ``replay()`` runs the captured function again and copies
    its results into the outputs the capture returned."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        for dst, src in zip(*((self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,)))):
            dst.copy_(src)


def eager_runner(engine, max_batch: int):
    """A ``DecodeGraphRunner`` whose capture is emulated on CPU by re-running the recorded function."""

    class EagerRunner(DecodeGraphRunner):
        def record(self, fn, generator=None):
            out = fn()
            return _EagerReplay(fn, out), out

    return EagerRunner(engine, max_batch=max_batch)


def drive_arrivals(eng: RolloutEngine, prompts, params, every: int, per: int) -> list:
    """Step ``eng`` while ``per`` requests arrive every ``every`` steps (the others decode meanwhile,
    so most steps are mixed); the outputs in request order."""
    ids, done, pending, step = [], {}, list(zip(prompts, params)), 0
    while pending or len(done) < len(ids):
        if pending and step % every == 0:
            ids += [eng.add_request(p, sp) for p, sp in pending[:per]]
            pending = pending[per:]
        done.update({o.request_id: o for o in eng.step()})
        step += 1
    return [done[i] for i in ids]


def sampled_mix(n: int, eos: tuple[int, ...]) -> list[SamplingParams]:
    """Greedy and seeded sampling rows with top-p / top-k, min_new_tokens and extra stop ids."""
    kinds = [
        lambda i: SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=9 + i, min_new_tokens=6, seed=100 + i),
        lambda i: SamplingParams(temperature=0, max_new_tokens=7 + i, min_new_tokens=4),
        lambda i: SamplingParams(temperature=0.7, top_k=12, max_new_tokens=14, stop_token_ids=(30, 41), seed=7 * i),
        lambda i: SamplingParams(temperature=1.3, max_new_tokens=5 + i, seed=i),
        lambda i: SamplingParams(
            temperature=1.0, top_p=0.8, top_k=20, max_new_tokens=12, min_new_tokens=9, stop_token_ids=(30,), seed=50 + i
        ),
    ]
    return [kinds[i % len(kinds)](i) for i in range(n)]


def sync_into(engine: RolloutEngine, new: dict, commit: str, through_data: bool = False) -> None:
    """Every tensor of ``new`` into ``engine`` through ``engine_receiver`` (the transports' receiving
    end) with ``commit``, as policy version 1; ``through_data``: written through ``.data`` (no
    parameter's version counter moves)."""
    specs = {n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in engine.weight_tensors().items()}
    receiver = engine_receiver(engine, specs, commit=commit)
    receiver.begin(1)
    for name in receiver.shard_specs():
        target = receiver.stage(name)
        (target.data if through_data else target).copy_(new[name])
    receiver.commit(1)
