"""LocalTrainBackend: loss normalisation, packing, checkpoints, sleep/wake, LoRA, export."""

import dataclasses
import json
import math
import multiprocessing as mp
import shutil

import pytest
import torch

from areno.errors import ConfigError
from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("train_tiny"))


def backend(model_dir, **kw):
    cfg = dict(lr=1e-2, device="cpu", grad_clip=None)
    cfg.update(kw)
    b = LocalTrainBackend(TrainBackendConfig(**cfg))
    b.initialize(model_dir)
    return b


def step(b, batch):
    return b.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)


def captured_grads(b, batch):
    grads = {}

    def hook(optimizer, args, kwargs):
        for name, p in b.model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().clone()

    handle = b.optimizer.register_step_pre_hook(hook)
    metrics = step(b, batch)
    handle.remove()
    return grads, metrics


def assert_grads_close(a, b, rtol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12)
        assert err < rtol, (name, float(err))


def test_gradient_same_for_1_and_4_micro_batches(model_dir):
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    one, m1 = captured_grads(backend(model_dir, max_tokens_per_mb=sum(LENGTHS)), batch)
    four, m4 = captured_grads(backend(model_dir, max_tokens_per_mb=22), batch)
    assert m1["mbs"] == 1 and m4["mbs"] == 4
    assert_grads_close(four, one)
    assert math.isclose(m1["loss"], m4["loss"], rel_tol=1e-6)
    # the reducer's global normalisation: summed metric of reducer(ones, mask) is exactly 1
    assert math.isclose(m4["nll_sum_check"], 1.0, rel_tol=1e-6)
    assert m4["tokens"] == sum(LENGTHS) and m4["loss_denominator"] == float(batch.loss_mask_T.sum())


def test_a_step_trains_in_train_mode_after_a_module_was_put_in_eval(model_dir):
    """The step puts every module in train mode only when one is not (it skips re-setting them)."""
    b = backend(model_dir)
    seen = []
    b.model.register_forward_pre_hook(lambda module, args: seen.append(all(m.training for m in module.modules())))
    next(iter(b.model.children())).eval()
    step(b, random_batch(LENGTHS, VOCAB, seed=1))
    assert seen and all(seen)


def test_packed_equals_unpacked_and_batch_order_restored(model_dir):
    batch = random_batch(LENGTHS, VOCAB, seed=2)
    packed = backend(model_dir, max_tokens_per_mb=64).forward_only(batch, forward_fn=nll_forward)
    b = backend(model_dir)
    alone = torch.cat([nll_forward(b.model, batch.select([i]))["logprobs_T"] for i in range(batch.num_seqs)])
    torch.testing.assert_close(packed["logprobs_T"], alone.detach(), rtol=1e-5, atol=1e-5)
    # an unpacked loss computed by hand equals the backend's
    metrics = step(b, batch)
    hand = -(alone * batch.loss_mask_T).sum() / batch.loss_mask_T.sum()
    assert math.isclose(metrics["loss"], float(hand.detach()), rel_tol=1e-5)


@pytest.fixture(params=["host", "queued"])
def step_path(request, monkeypatch):
    """Both ways a step clips and updates: decided on the host after reading the loss and norm, or
    queued on the device behind the last backward (``_queue_optimizer_step``: one CUDA process's
    default; forced here, CPU's fused AdamW takes ``found_inf`` too)."""
    from areno.train.backend import PackedTrainBackend

    if request.param == "queued":
        monkeypatch.setattr(PackedTrainBackend, "_queues_optimizer_step", lambda self: True)
    return request.param


def test_queued_step_equals_the_host_decided_step(model_dir, monkeypatch):
    from areno.train.backend import PackedTrainBackend

    runs = []
    for queued in (False, True):
        monkeypatch.setattr(PackedTrainBackend, "_queues_optimizer_step", lambda self, q=queued: q)
        b = backend(model_dir, grad_clip=0.05, schedule="linear_warmup", warmup_steps=2, weight_decay=0.1)
        metrics = [step(b, random_batch(LENGTHS, VOCAB, 300 + s)) for s in range(3)]
        runs.append((metrics, {n: p.detach().clone() for n, p in b.model.named_parameters()}, b))
    (m_host, p_host, b_host), (m_queued, p_queued, b_queued) = runs
    for a, q in zip(m_host, m_queued):
        assert math.isclose(a["loss"], q["loss"], rel_tol=1e-5) and a["lr"] == q["lr"] and a["step"] == q["step"]
        assert math.isclose(a["grad_norm"], q["grad_norm"], rel_tol=1e-5)
    for name, p in p_host.items():  # (k_proj's bias has a ~0 gradient: Adam moves it by its rounding noise)
        torch.testing.assert_close(p_queued[name], p, rtol=1e-5, atol=1e-5, msg=name)
    assert b_queued.optimizer.state_dict()["state"][0]["step"] == b_host.optimizer.state_dict()["state"][0]["step"]


def test_non_finite_grad_skips_step(model_dir, step_path):
    b = backend(model_dir)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}

    def bad_loss(output, mb, reducer):
        return reducer(-output["logprobs_T"] * float("nan"), mb.loss_mask_T), {}

    m = b.train_step(
        random_batch(LENGTHS, VOCAB, 3), forward_fn=nll_forward, loss_fn=bad_loss, denominator_fn=token_denominator
    )
    assert m["skipped_steps"] == 1 and not math.isfinite(m["grad_norm"])
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in b.model.parameters())
    assert m["lr"] == 0.0 and m["consecutive_skips"] == 1
    m = step(b, random_batch(LENGTHS, VOCAB, 3))
    assert m["skipped_steps"] == 1 and m["consecutive_skips"] == 0 and m["lr"] > 0
    # the skipped step counted no AdamW step (bias correction starts at the first taken one)
    assert {float(st["step"]) for st in b.optimizer.state.values()} == {1.0}


def test_grad_clip_and_schedule(model_dir, step_path):
    b = backend(model_dir, grad_clip=1e-3, schedule="linear_warmup", warmup_steps=2, lr=0.1)
    grads, m = captured_grads(b, random_batch(LENGTHS, VOCAB, 4))
    total = math.sqrt(sum(float(g.norm()) ** 2 for g in grads.values()))
    assert m["grad_norm"] > 1e-3 and math.isclose(total, 1e-3, rel_tol=1e-3)
    assert math.isclose(m["lr"], 0.05) and math.isclose(step(b, random_batch(LENGTHS, VOCAB, 5))["lr"], 0.1)


def _resume_worker(model_dir, ckpt, out):
    torch.set_num_threads(1)
    b = backend(model_dir, schedule="cosine", warmup_steps=1, total_steps=6, weight_decay=0.1)
    extra = b.load_checkpoint(ckpt)
    losses = [step(b, random_batch(LENGTHS, VOCAB, 100 + s))["loss"] for s in range(extra["next"], 6)]
    torch.save(losses, out)


def test_resume_same_process_is_bit_for_bit(model_dir, tmp_path):
    def run(b, steps):
        return [step(b, random_batch(LENGTHS, VOCAB, 200 + s))["loss"] for s in steps]

    kw = dict(schedule="linear_warmup", warmup_steps=3, weight_decay=0.1, grad_clip=0.1)
    straight = run(backend(model_dir, **kw), range(4))
    b = backend(model_dir, **kw)
    first = run(b, range(2))
    b.save_checkpoint(tmp_path / "ck", {"next": 2})
    torch.manual_seed(1234)  # clobber the RNG: load must restore it
    resumed = backend(model_dir, **kw)
    assert resumed.load_checkpoint(tmp_path / "ck") == {"next": 2}
    assert first + run(resumed, range(2, 4)) == straight


@pytest.mark.slow
def test_resume_is_bit_for_bit(model_dir, tmp_path):
    """6 steps straight == 3 steps, checkpoint, a new process, 3 more (spawn: slow tier)."""

    def fresh():
        return backend(model_dir, schedule="cosine", warmup_steps=1, total_steps=6, weight_decay=0.1)

    b = fresh()
    straight = [step(b, random_batch(LENGTHS, VOCAB, 100 + s))["loss"] for s in range(6)]
    b = fresh()
    first = [step(b, random_batch(LENGTHS, VOCAB, 100 + s))["loss"] for s in range(3)]
    b.save_checkpoint(tmp_path / "ckpt", {"next": 3})
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_resume_worker, args=(model_dir, tmp_path / "ckpt", tmp_path / "l.pt"))
    p.start()
    p.join()
    assert p.exitcode == 0
    assert first + torch.load(tmp_path / "l.pt", weights_only=True) == straight


def test_checkpoint_from_other_shape_names_tensor(model_dir, tmp_path):
    b = backend(model_dir)
    b.save_checkpoint(tmp_path / "ck", {})
    other = backend(make_model_dir(tmp_path / "wide", hidden=48))
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(\d+, 32\).*\(\d+, 48\)"):
        other.load_checkpoint(tmp_path / "ck")


def test_sleep_wake_round_trip(model_dir):
    b = backend(model_dir)
    step(b, random_batch(LENGTHS, VOCAB, 6))  # optimizer state exists
    weights = {k: v.clone() for k, v in b.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in b.optimizer.state.values()]
    n_params = sum(p.numel() * 4 for p in b.model.parameters())
    freed = b.sleep()
    assert freed >= 2 * n_params  # the two Adam moments (the weights stay: the sync after a rollout reads them)
    assert all(v.untyped_storage().nbytes() == 0 for s in b.optimizer.state.values() for v in s.values() if v.dim())
    assert all(p.untyped_storage().nbytes() > 0 for p in b.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        step(b, random_batch(LENGTHS, VOCAB, 7))
    assert b.wake() == freed
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, weights[k])
    for s, m in zip(b.optimizer.state.values(), moments):
        assert torch.equal(s["exp_avg"], m)
    # training continues exactly as without the nap
    ref = backend(model_dir)
    step(ref, random_batch(LENGTHS, VOCAB, 6))
    assert step(b, random_batch(LENGTHS, VOCAB, 8))["loss"] == step(ref, random_batch(LENGTHS, VOCAB, 8))["loss"]


def test_a_lazy_wake_keeps_the_optimizer_state_parked_until_its_first_use(model_dir, tmp_path):
    """wake(lazy=True): forwards run at once, the moments come back at the optimizer step (after the last
    backward) or a checkpoint save; a sleep before either has nothing left to move. The same numbers."""
    b, ref = backend(model_dir), backend(model_dir)
    for x in (b, ref):
        step(x, random_batch(LENGTHS, VOCAB, 6))

    def moment_bytes():
        return sum(
            s[k].untyped_storage().nbytes() for s in b.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
        )

    resident = moment_bytes()
    assert b.sleep() >= resident > 0
    assert b.wake(lazy=True) == 0 and moment_bytes() == 0
    b.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)  # weights only: stays parked
    assert moment_bytes() == 0
    assert b.sleep() == 0  # still in host memory: nothing to move
    with pytest.raises(RuntimeError, match="asleep"):
        step(b, random_batch(LENGTHS, VOCAB, 7))
    b.wake(lazy=True)
    at_step = []
    b.optimizer.register_step_pre_hook(lambda opt, args, kwargs: at_step.append(moment_bytes()))
    b.model.register_forward_pre_hook(lambda module, args: at_step.append(moment_bytes()))
    assert step(b, random_batch(LENGTHS, VOCAB, 8)) == step(ref, random_batch(LENGTHS, VOCAB, 8))
    assert at_step[0] == 0 and at_step[-1] == resident
    b.sleep()
    b.wake(lazy=True)
    b.save_checkpoint(tmp_path / "ck", extra_state={})  # reads the moments: they come back first
    assert moment_bytes() == resident
    ref.save_checkpoint(tmp_path / "ref", extra_state={})
    for x, y in zip(b.optimizer.state.values(), ref.optimizer.state.values()):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
    sum(p.sum() for p in b.model.parameters()).backward()  # gradients outside a step: parked with the state
    grads = [p.grad.clone() for p in b.model.parameters()]
    b.sleep()
    assert b.wake(lazy=True) > 0 and moment_bytes() == resident  # backward adds to them: all back at once
    assert all(torch.equal(p.grad, g) for p, g in zip(b.model.parameters(), grads))


def test_lora_trains_only_adapters_and_exports_merged(model_dir, tmp_path):
    b = backend(model_dir, lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), lr=0.05)
    base = {k: v.clone() for k, v in b.model.state_dict().items()}
    trainable = {n for n, p in b.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    opt_params = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for n, p in b.model.named_parameters() if p.requires_grad}
    for s in range(2):
        step(b, random_batch(LENGTHS, VOCAB, 10 + s))
    after = b.model.state_dict()
    for k, v in after.items():
        assert torch.equal(v, base[k]) != (".lora_B" in k or ".lora_A" in k), k
    merged = dict(b.named_weights())
    plain = backend(model_dir)
    assert list(merged) == list(plain.model.state_dict())  # HF names, same order
    q = "model.layers.0.self_attn.q_proj"
    a, bb = after[f"{q}.lora_A.default.weight"], after[f"{q}.lora_B.default.weight"]
    torch.testing.assert_close(merged[f"{q}.weight"], after[f"{q}.base_layer.weight"] + 2.0 * bb @ a)
    # export: transformers loads it and reproduces our forward
    b.export_hf(tmp_path / "hf")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(3, VOCAB, (1, 12))
    ours = plain.model
    ours.load_state_dict(merged)
    ref = hf(ids).logits[0]
    got = ours.logits(ours(ids[0], torch.arange(12)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_frozen_role_has_no_optimizer_and_scores(model_dir):
    b = backend(model_dir, trainable=False)
    assert b.optimizer is None and not any(p.requires_grad for p in b.model.parameters())
    with pytest.raises(ValueError, match="frozen role"):
        step(b, random_batch(LENGTHS, VOCAB, 1))
    out = b.forward_only(random_batch(LENGTHS, VOCAB, 1), forward_fn=nll_forward)
    assert out["logprobs_T"].shape == (sum(LENGTHS),)


def test_activation_checkpointing_same_gradient(model_dir):
    batch = random_batch(LENGTHS, VOCAB, seed=9)
    plain, _ = captured_grads(backend(model_dir), batch)
    ac_backend = backend(model_dir, activation_checkpointing=True)
    ac, _ = captured_grads(ac_backend, batch)
    assert_grads_close(ac, plain, rtol=1e-6)
    assert list(ac_backend.model.state_dict()) == list(backend(model_dir).model.state_dict())


def test_forward_output_without_shape_suffix_is_an_error(model_dir):
    b = backend(model_dir)
    with pytest.raises(ValueError, match="must end in _T"):
        b.forward_only(random_batch(LENGTHS, VOCAB, 1), forward_fn=lambda m, mb: {"x": mb.input_ids_T})


def test_sequence_level_denominator_independent_of_split(model_dir):
    """A per-sequence mean (denominator = number of sequences) is also split-invariant."""

    def seq_loss(output, mb, reducer):
        seq_id_T = torch.repeat_interleave(torch.arange(mb.num_seqs), mb.seqlens_B)
        nll_B = torch.zeros(mb.num_seqs).index_add(0, seq_id_T, -output["logprobs_T"] * mb.loss_mask_T)
        count_B = torch.zeros(mb.num_seqs).index_add(0, seq_id_T, mb.loss_mask_T.float())
        return reducer(nll_B / count_B), {}

    batch = random_batch(LENGTHS, VOCAB, seed=11)
    results = []
    for budget in (sum(LENGTHS), 22):
        b = backend(model_dir, max_tokens_per_mb=budget)
        grads = {}
        b.optimizer.register_step_pre_hook(
            lambda opt, a, k, grads=grads, b=b: grads.update({n: p.grad.clone() for n, p in b.model.named_parameters()})
        )
        m = b.train_step(batch, forward_fn=nll_forward, loss_fn=seq_loss, denominator_fn=lambda mb: mb.num_seqs)
        results.append((grads, m))
    assert results[1][1]["mbs"] == 4 and results[1][1]["loss_denominator"] == len(LENGTHS)
    assert_grads_close(results[1][0], results[0][0])
    assert math.isclose(results[0][1]["loss"], results[1][1]["loss"], rel_tol=1e-6)


def test_over_long_sequence_is_an_error_naming_both_numbers(model_dir):
    b = backend(model_dir, max_tokens_per_mb=16)
    with pytest.raises(ValueError, match=r"has 21 tokens, more than max_tokens_per_mb=16.*long_sequences='truncate'"):
        step(b, random_batch(LENGTHS, VOCAB, 3))
    with pytest.raises(ValueError, match="train.long_sequences: must be error or truncate"):
        TrainBackendConfig(long_sequences="split")


def test_truncate_trains_on_the_first_tokens_and_scores_zero_after(model_dir):
    batch = random_batch(LENGTHS, VOCAB, 3)
    keep_T = batch.position_ids_T() < 16
    # Causal attention: a sequence's first 16 tokens score the same with or without its tail.
    full = backend(model_dir, max_tokens_per_mb=64).forward_only(batch, forward_fn=nll_forward)["logprobs_T"]
    cut = backend(model_dir, max_tokens_per_mb=16, long_sequences="truncate")
    scores = cut.forward_only(batch, forward_fn=nll_forward)["logprobs_T"]
    assert scores.shape == full.shape and bool((scores[~keep_T] == 0).all())
    torch.testing.assert_close(scores[keep_T], full[keep_T], rtol=1e-5, atol=1e-6)
    # Training: the same loss and gradient as masking the tail out of the loss of the whole batch.
    ref = backend(model_dir, max_tokens_per_mb=64)
    grads_ref, m_ref = captured_grads(ref, dataclasses.replace(batch, loss_mask_T=batch.loss_mask_T & keep_T))
    grads_cut, m_cut = captured_grads(cut, batch)
    assert m_cut["truncated_tokens"] == (~keep_T).sum() == 21 - 16 and m_ref["truncated_tokens"] == 0
    assert abs(m_cut["loss"] - m_ref["loss"]) < 1e-6
    assert_grads_close(grads_cut, grads_ref)


def test_lora_adapter_only_export_loads_in_peft(model_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    b = backend(model_dir, lora=lora, lr=0.05)
    for s in range(2):
        step(b, random_batch(LENGTHS, VOCAB, 20 + s))
    # adapter-only optimizer state: every parameter with Adam moments is an adapter
    names = {id(p): n for n, p in b.model.named_parameters()}
    assert b.optimizer.state and all(".lora_" in names[id(p)] for p in b.optimizer.state)
    adapters = dict(b.named_adapter_weights())
    expected = {
        f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    }
    assert set(adapters) == expected
    live = b.model.state_dict()
    q = "model.layers.1.self_attn.q_proj"
    assert torch.equal(adapters[f"base_model.model.{q}.lora_B.weight"], live[f"{q}.lora_B.default.weight"])
    merged = dict(b.named_weights())
    torch.testing.assert_close(
        merged[f"{q}.weight"],
        live[f"{q}.base_layer.weight"]
        + 2.0 * adapters[f"base_model.model.{q}.lora_B.weight"] @ adapters[f"base_model.model.{q}.lora_A.weight"],
    )
    # PEFT loads the adapter-only export on the untouched base model and matches the merged weights
    b.export_adapter(tmp_path / "adapter")
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ours = backend(model_dir).model
    ours.load_state_dict(merged)
    ids = torch.randint(3, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.logits(ours(ids[0], torch.arange(12))), peft_model(ids).logits[0], rtol=1e-4, atol=1e-4
        )
    with pytest.raises(ValueError, match="needs LoRA"):
        next(backend(model_dir).named_adapter_weights())


def test_cpu_default_budget_follows_host_memory_within_its_bounds(model_dir, monkeypatch):
    """``train.max_tokens_per_mb=null`` on CPU: the activation estimate over a quarter of the host's
    available memory, kept within ``CPU_TOKENS_PER_MB``; the lower bound where /proc/meminfo is missing."""
    from areno.train import backend as backend_mod
    from areno.train.packing import estimate_max_tokens_per_mb

    lo, hi = backend_mod.CPU_TOKENS_PER_MB
    b = backend(model_dir)
    mc = b.model_config
    assert b.max_tokens_per_mb == b._default_tokens_per_mb()  # what the backend plans with
    per_token_bytes = (1 << 30) // estimate_max_tokens_per_mb(  # the estimate's bytes a token, at 1 GiB free
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_layers=mc.num_hidden_layers,
        vocab_size=mc.vocab_size,
        q_kv_dim=(mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim,
        free_bytes=1 << 30,
        compute_bytes=4,
    )
    for available, expected in [
        (None, lo),
        (1 << 20, lo),  # a small host: the lower bound (what areno used on every CPU before)
        (1 << 50, hi),
    ]:
        monkeypatch.setattr(backend_mod, "available_host_bytes", lambda a=available: a)
        assert b._default_tokens_per_mb() == expected, available
    # in between: the estimate itself (a multiple of 256)
    monkeypatch.setattr(
        backend_mod, "available_host_bytes", lambda: backend_mod.CPU_MEMORY_SHARE * 8000 * per_token_bytes
    )
    assert lo < b._default_tokens_per_mb() < hi and b._default_tokens_per_mb() % 256 == 0


def test_forward_only_of_a_lora_model_with_dropout_is_the_merged_models(model_dir, tmp_path):
    """walk15: with train.lora.dropout > 0 the backend stays in train mode, and forward_only (the old policy's
    recomputed log-probs, a critic's values) drew a dropout mask: two calls on one batch differed by 0.2 nats.
    Dropout is off there now: both calls equal the merged weights' forward; training steps keep it."""
    b = backend(model_dir, lora=LoraConfig(rank=4, alpha=8, dropout=0.3, target_modules=("q_proj", "v_proj")), lr=0.05)
    step(b, random_batch(LENGTHS, VOCAB, 10))  # lora_B leaves 0: the adapters change the forward
    batch = random_batch(LENGTHS, VOCAB, 11)
    first = b.forward_only(batch, forward_fn=nll_forward)["logprobs_T"]
    second = b.forward_only(batch, forward_fn=nll_forward)["logprobs_T"]
    assert torch.equal(first, second)
    plain = backend(model_dir)
    plain.model.load_state_dict(dict(b.named_weights()))
    merged = plain.forward_only(batch, forward_fn=nll_forward)["logprobs_T"]
    torch.testing.assert_close(first, merged, rtol=1e-4, atol=1e-4)
    assert all(m.training for m in b.model.modules() if isinstance(m, torch.nn.Dropout))  # restored


def test_the_hf_export_keeps_the_source_models_generation_config(model_dir, tmp_path):
    """walk15: the export wrote a generation_config.json from config.json alone (one EOS id, no sampling
    defaults) over the source's, which areno serve, vLLM and transformers' generate then read."""
    source_dir = shutil.copytree(model_dir, tmp_path / "source")
    path = source_dir / "generation_config.json"
    source = json.loads(path.read_text()) if path.is_file() else {}
    source.update({"eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9})
    path.write_text(json.dumps(source))
    b = backend(source_dir)
    b.export_hf(tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert exported["eos_token_id"] == [2, 5] and exported["temperature"] == 0.6 and exported["top_p"] == 0.9


def test_float32_compute_over_bfloat16_weights_is_refused_in_one_process(model_dir):
    """walk21: model.dtype=bfloat16 with model.compute_dtype=float32 ran every training forward in bf16 on the
    one-process backend (autocast only narrows); `auto` on CPU named float32 for it too. The explicit setting
    is now one line naming both keys, and `auto` resolves to bfloat16 over bfloat16 weights."""
    with pytest.raises(ConfigError, match=r"model.compute_dtype=float32 with model.dtype=bfloat16"):
        backend(model_dir, dtype="bfloat16", param_dtype="float32")
    cfg = TrainBackendConfig(lr=1e-2, device="cpu", dtype="bfloat16")
    assert cfg.resolved_param_dtype("cpu") == "bfloat16"
    assert TrainBackendConfig(lr=1e-2, device="cpu").resolved_param_dtype("cpu") == "float32"


def test_weight_decay_spares_biases_and_norms_unless_asked(model_dir):
    """transformers' rule by default: the matrices decay, the biases and norm scales keep their values;
    ``decay_biases_and_norms`` decays them too (one group, what areno did before)."""
    for decay_all in (False, True):
        b = backend(model_dir, lr=0.1, weight_decay=0.5, decay_biases_and_norms=decay_all)
        before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
        for p in b.model.parameters():
            p.grad = torch.zeros_like(p)  # Adam's update is 0: only the decay moves a weight
        b.optimizer.step()
        assert len(b.optimizer.param_groups) == (1 if decay_all else 2)
        for name, p in b.model.named_parameters():
            shrunk = before[name] * (1 - 0.1 * 0.5)
            expected = shrunk if p.ndim >= 2 or decay_all else before[name]
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=name)
        assert any(p.ndim == 1 for p in b.model.parameters()) and any(p.ndim == 2 for p in b.model.parameters())


def test_a_checkpoint_of_one_param_group_resumes_into_two_bit_for_bit(model_dir, tmp_path):
    """A checkpoint of an optimizer of one group (areno before biases and norms were spared, or
    ``decay_biases_and_norms``) loads into this run's two groups: each parameter's Adam state restored,
    each group at its own weight decay; without decay both layouts train the same, bit for bit."""

    def run(b, steps):
        return [step(b, random_batch(LENGTHS, VOCAB, 500 + s))["loss"] for s in steps]

    kw = dict(schedule="cosine", warmup_steps=1, total_steps=4)
    one = backend(model_dir, decay_biases_and_norms=True, **kw)
    first = run(one, range(2))
    one.save_checkpoint(tmp_path / "ck", {})
    saved = {n: one.optimizer.state[p]["exp_avg"].clone() for n, p in one.model.named_parameters()}
    straight = first + run(one, range(2, 4))
    two = backend(model_dir, **kw)
    assert len(two.optimizer.param_groups) == 2
    two.load_checkpoint(tmp_path / "ck")
    assert first + run(two, range(2, 4)) == straight
    assert [g["lr"] for g in two.optimizer.param_groups] == [one.optimizer.param_groups[0]["lr"]] * 2
    decayed = backend(model_dir, weight_decay=0.1, **kw)
    decayed.load_checkpoint(tmp_path / "ck")
    assert [g["weight_decay"] for g in decayed.optimizer.param_groups] == [0.1, 0.0]
    assert decayed.scheduler.base_lrs == [1e-2, 1e-2]
    for name, p in decayed.model.named_parameters():
        assert torch.equal(decayed.optimizer.state[p]["exp_avg"], saved[name]), name


def test_a_checkpoint_of_two_param_groups_resumes_into_one(model_dir, tmp_path):
    """``decay_biases_and_norms`` turned on at a resume: the checkpoint's optimizer and schedule have two
    groups (matrices, vectors), this run's one; each parameter's Adam state and the schedule's position are
    restored (the schedule's per-group lists are this run's), and the run trains on as one group would."""
    kw = dict(schedule="cosine", warmup_steps=1, total_steps=4, weight_decay=0.1)
    two = backend(model_dir, **kw)
    step(two, random_batch(LENGTHS, VOCAB, 600))
    two.save_checkpoint(tmp_path / "ck", {})
    saved = {n: two.optimizer.state[p]["exp_avg"].clone() for n, p in two.model.named_parameters()}
    one = backend(model_dir, decay_biases_and_norms=True, **kw)
    one.load_checkpoint(tmp_path / "ck")
    (group,) = one.optimizer.param_groups
    assert group["weight_decay"] == 0.1 and one.scheduler.base_lrs == [1e-2] and one.scheduler.last_epoch == 1
    assert one.scheduler.get_last_lr() == [two.optimizer.param_groups[0]["lr"]]
    for name, p in one.model.named_parameters():
        assert torch.equal(one.optimizer.state[p]["exp_avg"], saved[name]), name
    assert math.isfinite(step(one, random_batch(LENGTHS, VOCAB, 601))["loss"])
