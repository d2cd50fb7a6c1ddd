"""oneDNN-packed CPU inference GEMMs (``areno.models.cpu_gemm``, ``RolloutEngineConfig.cpu_packed_gemm``):
the packed product equals ``F.linear`` up to summation order (fp32, and bf16 where the CPU has it), a packed copy never serves stale
weights (in-place writes, replaced storage, ``update_weights``, from disk, every policy-sync commit),
and an engine with packed copies generates what an engine without them generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areno.models import cpu_gemm
from areno.models.decoder import Decoder
from areno.models.hf_io import save_model, tiny_config
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from tests.helpers.rollout import ARCHS, SEEDED, model_of, random_prompts, run, sync_into

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="no oneDNN packed linear in this PyTorch build")


def assert_close_runs(a, b) -> None:
    """Same tokens; log-probs equal up to fp32 summation order (the packed GEMM sums in another order)."""
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-4)


@pytest.fixture
def pack_everything(monkeypatch):
    """The tiny test models' weights and 5-row batches are below the speed thresholds: pack them all."""
    monkeypatch.setattr(cpu_gemm, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(cpu_gemm, "MIN_ROWS", 1)


@pytest.fixture
def bf16_packing(monkeypatch):
    """bf16 weights packed as on a CPU with native bf16 (oneDNN runs the product here, natively or
    emulated); skipped where this oneDNN has no packed bf16 linear."""
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: True)
    if not cpu_gemm.supported_bf16.__wrapped__():
        pytest.skip("no oneDNN packed bf16 linear on this CPU")
    monkeypatch.setattr(cpu_gemm, "supported_bf16", lambda: True)


def engine_of(model, cfg, packed: bool, **kw) -> RolloutEngine:
    config = RolloutEngineConfig(
        block_size=4,
        num_blocks=96,
        max_num_seqs=5,
        max_model_len=80,
        prefill_chunk_size=8,
        cpu_packed_gemm=packed,
        **kw,
    )
    return RolloutEngine(model, cfg, config=config, eos_token_ids=())


class Holder:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def pack_of(weight: torch.Tensor, batch_hint: int = 8) -> cpu_gemm.PackedWeight | None:
    return cpu_gemm.pack((Holder(weight), "weight"), batch_hint=batch_hint)


@torch.no_grad()
def test_packed_product_equals_linear(pack_everything):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    pack = pack_of(w)
    x = torch.randn(3, 7, 40, generator=g)  # leading dims kept; a non-contiguous input too
    torch.testing.assert_close(pack(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(40, 12, generator=g).t()
    assert not xt.is_contiguous()
    torch.testing.assert_close(pack(xt, None), F.linear(xt, w), rtol=1e-5, atol=1e-5)
    assert pack.repacks == 1  # packed once, reused


def test_packed_copy_is_read_only_where_it_pays(monkeypatch):
    """Real thresholds: not under autograd, not for bf16 on a CPU without native bf16, not for another
    dtype than the weight's, not for few fp32 rows of a small weight; the output-projection-sized
    weight at any row count."""
    small = pack_of(torch.zeros(1024, 256), 32)  # 2**18 elements
    large = pack_of(torch.zeros(16384, 256), 32)  # 2**22
    assert pack_of(torch.zeros(256, 256)) is None  # below MIN_ELEMENTS
    assert pack_of(torch.zeros(512, 256)) is not None  # 2**17: at MIN_ELEMENTS
    monkeypatch.setattr(cpu_gemm, "supported_bf16", lambda: False)
    assert pack_of(torch.zeros(1024, 256, dtype=torch.bfloat16)) is None
    assert small is not None and large is not None and large.large and not small.large
    with torch.no_grad():
        assert small.applies(torch.zeros(8, 256)) and not small.applies(torch.zeros(7, 256))
        assert large.applies(torch.zeros(1, 256))
        assert not small.applies(torch.zeros(8, 256, dtype=torch.bfloat16))
    with torch.enable_grad():
        assert not small.applies(torch.zeros(8, 256)) and not large.applies(torch.zeros(1, 256))


def test_bf16_copies_are_read_at_any_row_count(bf16_packing):
    """bf16 (native): ``F.linear`` reorders the weight at every call at any row count, so the packed
    copy pays from one row; only bf16 inputs read a bf16 copy."""
    small = pack_of(torch.zeros(1024, 256, dtype=torch.bfloat16), 32)
    assert small is not None and small.dtype == torch.bfloat16 and not small.large
    with torch.no_grad():
        assert small.applies(torch.zeros(1, 256, dtype=torch.bfloat16))
        assert not small.applies(torch.zeros(8, 256))  # fp32 rows: F.linear's own promotion rules
    with torch.enable_grad():
        assert not small.applies(torch.zeros(8, 256, dtype=torch.bfloat16))


@torch.no_grad()
def test_bf16_packed_product_equals_linear(bf16_packing, pack_everything):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    pack = pack_of(w)
    for rows in (1, 5, 37):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        got, want = pack(x, b), F.linear(x, w, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_packed_engine_equals_unpacked_engine(arch, bf16_packing, pack_everything):
    """A bf16 engine (the ``auto`` rollout dtype on a CPU with native bf16): same tokens, log-probs
    within bf16 summation-order differences."""
    prompts = random_prompts(9, seed=4, hi=30)
    packed_model, cfg = model_of(arch)
    plain_model, _ = model_of(arch)
    packed_model, plain_model = packed_model.to(torch.bfloat16), plain_model.to(torch.bfloat16)
    packed, plain = engine_of(packed_model, cfg, True), engine_of(plain_model, cfg, False)
    assert len(packed_model._cpu_packs) == 4 * cfg.num_hidden_layers + 1
    a, b = run(packed, prompts), run(plain, prompts)
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=2e-2)
    assert all(p.repacks == 1 for p in packed_model._cpu_packs)


@torch.no_grad()
def test_packed_copy_follows_weight_writes(pack_everything):
    lin = torch.nn.Linear(40, 96)
    pack = cpu_gemm.pack((lin, "weight"), batch_hint=8)
    x = torch.randn(9, 40)

    def check() -> None:
        torch.testing.assert_close(pack(x, lin.bias), lin(x), rtol=1e-5, atol=1e-5)

    check()
    lin.weight.copy_(torch.randn(96, 40))  # in place through the parameter: its version counter moves
    check()
    lin.weight.data = torch.randn(96, 40)  # replaced storage
    check()
    lin.weight = torch.nn.Parameter(torch.randn(96, 40))  # a replaced parameter (load_state_dict(assign=True))
    check()
    lin.bias.copy_(torch.randn(96))  # the bias is read live, never packed
    check()
    # A write through ``.data`` moves no version counter: the engine invalidates on every commit.
    lin.weight.data.copy_(torch.randn(96, 40))
    pack.invalidate()
    check()
    assert pack.repacks == 5


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_engine_equals_unpacked_engine(arch, pack_everything):
    """Greedy and seeded sampling, chunked prefill, continuous batching (5 slots, 9 requests)."""
    prompts = random_prompts(9, seed=3, hi=30)
    packed_model, cfg = model_of(arch)
    plain_model, _ = model_of(arch)
    packed, plain = engine_of(packed_model, cfg, True), engine_of(plain_model, cfg, False)
    # fused q/k/v and gate/up (one copy per group), o_proj, down_proj and the output projection
    assert len(packed_model._cpu_packs) == 4 * cfg.num_hidden_layers + 1 and not plain_model._cpu_packs
    assert_close_runs(run(packed, prompts), run(plain, prompts))
    assert_close_runs(run(packed, prompts[:4], SEEDED), run(plain, prompts[:4], SEEDED))
    assert all(p.repacks == 1 for p in packed_model._cpu_packs)  # every copy was read, none re-packed


def test_a_deep_copy_multiplies_its_own_weights(pack_everything):
    """``copy.deepcopy`` of a packed model: the copy's products read the copy's weights, also after
    they change (a copy re-packs from its own parameters)."""
    import copy

    model, cfg = model_of("qwen2")
    engine_of(model, cfg, True)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ids, pos = torch.tensor([5, 9, 11, 3, 7, 8, 20, 4, 6]), torch.arange(9)
    with torch.no_grad():
        got = twin.logits(twin(ids, pos))
        twin.unpack_cpu_gemms()
        want = twin.logits(twin(ids, pos))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unfused_projections_get_their_own_copies(pack_everything):
    model, cfg = model_of("qwen2")
    engine = engine_of(model, cfg, True, fused_projections=False)
    assert len(model._cpu_packs) == 7 * cfg.num_hidden_layers + 1
    ref, _ = model_of("qwen2")
    assert_close_runs(
        run(engine, random_prompts(4, seed=5)), run(engine_of(ref, cfg, False), random_prompts(4, seed=5))
    )


def test_flag_validated_and_false_unpacks(pack_everything):
    with pytest.raises(ValueError, match="rollout.cpu_packed_gemm: must be true or false"):
        RolloutEngineConfig(cpu_packed_gemm="yes")
    model, cfg = model_of("qwen2")
    engine_of(model, cfg, True)
    assert model._cpu_packs
    engine_of(model, cfg, False)
    assert not model._cpu_packs and "cpu_pack" not in model.model.layers[0].mlp.down_proj.__dict__


def test_real_thresholds_pick_the_large_weights():
    """Without the test override: a 24M-parameter-like layer packs gate/up, down_proj and q/k/v (>= 2**17
    elements) and the 32k-vocabulary output projection, not o_proj (2**16)."""
    cfg = tiny_config(32000, hidden_size=256, layers=1, heads=8, kv_heads=4, intermediate_size=1024)
    model = Decoder(cfg).eval()
    model.fuse_projections()
    assert model.pack_cpu_gemms(batch_hint=32) == 4
    assert model.cpu_packed_bytes == 4 * (512 * 256 + 2048 * 256 + 256 * 1024 + 32000 * 256)
    layer = model.model.layers[0]
    assert "cpu_pack" in layer.mlp.gate_up.__dict__ and "cpu_pack" in layer.mlp.down_proj.__dict__
    assert "cpu_pack" in layer.self_attn.qkv.__dict__ and "cpu_pack" not in layer.self_attn.o_proj.__dict__
    assert model.__dict__["cpu_pack"].large
    ids = torch.randint(3, 32000, (20,))
    with torch.no_grad():
        packed = model.logits(model(ids, torch.arange(20)))
        model.unpack_cpu_gemms()
        plain = model.logits(model(ids, torch.arange(20)))
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_update_weights_repacks(arch, pack_everything):
    """``update_weights`` (a subset, then all) on a packed engine serves what an unpacked engine
    loaded with the same tensors serves."""
    prompts = random_prompts(4, seed=8)
    model, cfg = model_of(arch)
    packed = engine_of(model, cfg, True)
    run(packed, prompts)
    new = model_of(arch, seed=7)[0].state_dict()
    subset = [(n, t) for n, t in new.items() if ".self_attn.v_proj." in n or "mlp.up_proj" in n or "lm_head" in n]
    packed.update_weights(subset, version=1)
    partial, _ = model_of(arch)
    partial.load_state_dict({**partial.state_dict(), **dict(subset)})
    assert_close_runs(run(packed, prompts), run(engine_of(partial, cfg, False), prompts))
    packed.update_weights(new.items(), version=2)
    ref, _ = model_of(arch, seed=7)
    assert_close_runs(run(packed, prompts), run(engine_of(ref, cfg, False), prompts))


def test_update_weights_from_disk_repacks(tmp_path, pack_everything):
    prompts = random_prompts(4, seed=9)
    model, cfg = model_of("qwen2")
    packed = engine_of(model, cfg, True)
    run(packed, prompts)
    save_model(model_of("qwen2", seed=4)[0], cfg, tmp_path / "new")
    packed.update_weights_from_disk(str(tmp_path / "new"), version=3)
    ref, _ = model_of("qwen2", seed=4)
    assert_close_runs(run(packed, prompts), run(engine_of(ref, cfg, False), prompts))


@pytest.mark.parametrize("commit", ["staged", "swap", "inplace"])
def test_policy_sync_into_packed_engine(commit, pack_everything):
    """The transports' receiving end (staged copies, swap, in-place writes) into a packed engine that
    has already served the old weights: it then serves the new ones."""
    prompts = random_prompts(4, seed=10)
    model, cfg = model_of("qwen2")
    packed = engine_of(model, cfg, True)
    run(packed, prompts)
    sync_into(packed, model_of("qwen2", seed=6)[0].state_dict(), commit, through_data=True)
    ref, _ = model_of("qwen2", seed=6)
    assert_close_runs(run(packed, prompts), run(engine_of(ref, cfg, False), prompts))
    assert all(p.repacks == 2 for p in model._cpu_packs)


def test_rollout_key_reaches_the_engine(tiny_model_dir, tmp_path):
    from areno.api.config import load_config
    from areno.data.tokenizer import load_pretrained_tokenizer
    from areno.engine.api import resolve_device
    from areno.engine.local import LocalRolloutSide

    for value in (True, False):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"run_dir={tmp_path / 'run'}",
                "cluster.device=cpu",
                f"rollout.cpu_packed_gemm={str(value).lower()}",
            ],
        )
        colocated = LocalRolloutSide(cfg, resolve_device("cpu"))
        colocated.tokenizer = load_pretrained_tokenizer(tiny_model_dir)
        assert colocated._build_rollout_engine(tiny_model_dir).config.cpu_packed_gemm is value
