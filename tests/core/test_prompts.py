"""data.chat_template / data.system_prompt: one prompt renders to the same ids in the rollout
workflows, evaluation, SFT data and the server's chat route, equal to transformers'
``apply_chat_template(..., add_generation_prompt=True)`` for a Qwen-style and a Llama-style
template (tiny tokenizers built and saved here: no download)."""

import asyncio
import json

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.data.datasets import load_rows
from areno.data.prompts import render_prompt
from areno.data.tokenizer import build_char_tokenizer, load_pretrained_tokenizer
from areno.engine.api import preference_trajectories, sft_trajectories
from areno.errors import ConfigError, DataError
from areno.models.hf_io import init_model_dir, tiny_config
from areno.rollout.server import build_engine, create_app
from areno.types import GenerationOutput, SamplingParams
from areno.workflows.multi_turn import MultiTurnWorkflow
from areno.workflows.rlvr import RLVRWorkflow
from tests.helpers.serving import serving
from tests.helpers.templates import r1_tokenizer

QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+3?"}]
TRAIN_ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"},
    {"prompt": "What is 1+1?", "answer": "2"},
]


def _save_tokenizer(path, template, extra_tokens=()):
    """A tiny checkpoint at ``path`` whose character tokenizer carries ``template`` (None: none);
    returns the tokenizer as loaded from there."""
    tok = build_char_tokenizer(extra_tokens=extra_tokens)
    tok.chat_template = template
    init_model_dir(path, tiny_config(len(tok), hidden_size=32, layers=1), tok, seed=0)
    return load_pretrained_tokenizer(path)


@pytest.fixture(scope="module", params=["qwen", "llama"])
def templated(request, tmp_path_factory):
    """(name, tokenizer) with a Qwen-style or a Llama-style chat template."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen":
        return request.param, _save_tokenizer(path, QWEN_TEMPLATE)
    return request.param, _save_tokenizer(path, LLAMA_TEMPLATE, LLAMA_TOKENS)


def _expected(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_render_equals_apply_chat_template(templated):
    _, tok = templated
    user = [{"role": "user", "content": "What is 2+3?"}]
    for mode in ("auto", "always"):
        assert render_prompt(tok, "What is 2+3?", chat_template=mode) == _expected(tok, user)
        assert render_prompt(tok, MESSAGES, chat_template=mode) == _expected(tok, MESSAGES)
        assert render_prompt(tok, "What is 2+3?", chat_template=mode, system_prompt="Be terse.") == _expected(
            tok, MESSAGES
        )
        # a row's own system message wins over data.system_prompt
        assert render_prompt(tok, MESSAGES, chat_template=mode, system_prompt="Other.") == _expected(tok, MESSAGES)
    assert render_prompt(tok, "What is 2+3?", chat_template="never") == list(tok.encode("What is 2+3?"))
    assert render_prompt(tok, "x", chat_template="auto") != list(tok.encode("x"))  # the template applied
    with pytest.raises(DataError, match="message-list prompt .* needs a chat template"):
        render_prompt(tok, MESSAGES, chat_template="never")
    with pytest.raises(DataError, match="message 1 is not an object"):
        render_prompt(tok, [{"role": "user", "content": "a"}, {"role": "user"}])


def test_demo_tokenizer_renders_raw_prompts():
    """The demo's character tokenizer (tiny models trained from scratch on raw prompts): ``auto``
    keeps today's ids; ``always`` applies its chat template."""
    tok = build_char_tokenizer()
    assert render_prompt(tok, "12+34=", chat_template="auto") == list(tok.encode("12+34="))
    assert render_prompt(tok, "12+34=", chat_template="always") == _expected(
        tok, [{"role": "user", "content": "12+34="}]
    )


class _RecordingClient:
    def __init__(self):
        self.prompts = []

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        self.prompts.append(list(prompt_ids))
        return GenerationOutput(
            request_id="r", prompt_ids=list(prompt_ids), output_ids=[5, 6], output_logprobs=[-0.5] * 2,
            output_versions=[0] * 2, finish_reason="stop",
        )  # fmt: skip


def test_workflows_and_sft_data_render_alike(templated):
    _, tok = templated
    seen = []

    def reward(prompt, completion, answer, **fields):
        seen.append((prompt, completion))
        return 0.0

    params = SamplingParams(max_new_tokens=2)
    row = {"prompt": MESSAGES, "answer": "5"}
    for workflow in (
        RLVRWorkflow(tok, reward, 2, params, chat_template="auto", system_prompt="Be terse."),
        MultiTurnWorkflow(tok, reward, params, max_turns=1, chat_template="auto", system_prompt="Be terse."),
    ):
        client = _RecordingClient()
        group = asyncio.run(workflow.run_episode(client, row))
        assert all(t.prompt_ids == _expected(tok, MESSAGES) for t in group)
        assert client.prompts[0] == _expected(tok, MESSAGES)
    # the reward gets the row's prompt as the dataset holds it (the messages) and the completion text
    assert seen[0] == (MESSAGES, tok.decode([5, 6], skip_special_tokens=True))
    (sft,) = sft_trajectories([{"q": "What is 2+3?", "a": "5"}], tok, "q", "a", system_prompt="Be terse.")
    assert sft.prompt_ids == _expected(tok, MESSAGES)


def test_server_chat_route_renders_like_training(templated):
    _, tok = templated
    engine, tokenizer = build_engine(tok.name_or_path, device="cpu", num_blocks=64, block_size=8, max_model_len=128)
    with serving(create_app(engine, tokenizer=tokenizer, model_name="tiny")) as base:
        res = httpx.post(
            f"{base}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, timeout=60
        ).json()
    assert res["choices"][0]["prompt_token_ids"] == render_prompt(tok, MESSAGES) == _expected(tok, MESSAGES)


def record_reward(prompt, completion, answer, **fields):
    """A reward for the Trainer test: records what it received."""
    RECEIVED.append(prompt)
    return 1.0


RECEIVED: list = []


def _config(tmp_path, model_dir, *extra):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    return load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            "data.task=null",
            f"data.train_path={data}",
            f"data.eval_path={data}",
            "reward.fn=tests.core.test_prompts:record_reward",
            "reward.sandbox=false",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=2",
            "cluster.device=cpu",
            "observe.console=false",
            *extra,
        ],
    )


def test_trainer_rollouts_and_evaluation_render_the_template(tmp_path):
    """Through ``Trainer``: data.system_prompt and message-list rows reach rollouts and evaluation."""
    tok = _save_tokenizer(tmp_path / "model", QWEN_TEMPLATE)
    cfg = _config(tmp_path, tmp_path / "model", "data.system_prompt=Be terse.")
    system = {"role": "system", "content": "Be terse."}
    expected = {
        tuple(_expected(tok, [system, {"role": "user", "content": q}])) for q in ("What is 2+3?", "What is 1+1?")
    }
    trainer = Trainer.init(cfg)
    try:
        rollout = trainer.backend.rollout_batch(0)
        assert {tuple(t.prompt_ids) for t in rollout.trajectories} == expected
        client = trainer.backend.engine.rollout.client
        seen_ids = []
        generate = client.agenerate

        async def arecording(prompt_ids, params, **kwargs):
            seen_ids.append(tuple(prompt_ids))
            return await generate(prompt_ids, params, **kwargs)

        client.agenerate = arecording
        RECEIVED.clear()
        metrics = trainer.backend.evaluate()
    finally:
        trainer.shutdown()
    assert metrics["eval/num_prompts"] == 2.0
    assert set(seen_ids) == expected
    assert TRAIN_ROWS[0]["prompt"] in RECEIVED and "What is 1+1?" in RECEIVED  # the rows' prompts, messages included


def test_demo_config_keeps_raw_prompt_ids(tmp_path):
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
            "data.task=arithmetic",
            "data.num_eval=4",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=2",
            "cluster.device=cpu",
            "observe.console=false",
        ],
    )
    assert cfg.data.chat_template == "auto"
    trainer = Trainer.init(cfg)
    try:
        tok = trainer.backend.engine.tokenizer
        rollout = trainer.backend.rollout_batch(0)
    finally:
        trainer.shutdown()
    for t in rollout.trajectories:
        assert t.prompt_ids == list(tok.encode(t.info["prompt"]))


def test_chat_template_checks_at_start_up(tmp_path):
    model = tmp_path / "model"
    tok = _save_tokenizer(model, None)
    assert tok.chat_template is None
    with pytest.raises(ConfigError, match="data.chat_template=always but the model's tokenizer has no chat template"):
        check_run(_config(tmp_path, model, "data.chat_template=always"))
    with pytest.raises(ConfigError, match="data.system_prompt is set but prompts are not wrapped"):
        check_run(_config(tmp_path, model, "data.system_prompt=hi"))
    with pytest.raises(ConfigError, match="data.chat_template"):
        _config(tmp_path, model, "data.chat_template=sometimes")
    with pytest.raises(ConfigError, match="data.system_prompt"):
        _config(tmp_path, model, "data.chat_template=never", "data.system_prompt=hi")


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_a_template_that_refuses_the_system_prompt_is_named_at_start_up(tmp_path):
    """walk30: Mistral-Instruct's template raises on a system message; every rollout failed, blamed on the
    rollout side."""
    model = tmp_path / "model"
    _save_tokenizer(model, MISTRAL_TEMPLATE)
    always = "data.chat_template=always"
    with pytest.raises(ConfigError, match=r"chat template fails with data.system_prompt's system message \(Template"):
        check_run(_config(tmp_path, model, always, "data.system_prompt=Be brief."))
    # a held-out row the template refuses (its system message) is named, not a bare TemplateError
    held_out = tmp_path / "held_out.jsonl"
    rows = [
        TRAIN_ROWS[0],
        {"prompt": [{"role": "system", "content": "Be brief."}, *TRAIN_ROWS[0]["prompt"]], "answer": "5"},
    ]
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataError, match=r"held_out.jsonl line 2: the chat template fails on its prompt \(TemplateError"
    ):
        check_run(_config(tmp_path, model, always, f"data.eval_path={held_out}"))


def test_message_list_rows_are_validated(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    assert load_rows(good, prompt_key="prompt")[0]["prompt"] == TRAIN_ROWS[0]["prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRAIN_ROWS[1]) + "\n" + json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2: 'prompt' is a message list but message 0 is not"):
        load_rows(bad, prompt_key="prompt")
    with pytest.raises(DataError, match="line 1: 'prompt' is a message list but the message list is empty"):
        bad.write_text(json.dumps({"prompt": []}) + "\n")
        load_rows(bad, prompt_key="prompt")


def test_offline_completions_carry_no_bos_of_their_own():
    """walk17: a completion was `tokenizer.encode(text)`, which adds BOS where the tokenizer's post-processor
    does (Llama, Mistral, Gemma): SFT, the warm start, DPO and the reward model trained a BOS in the middle of
    every sequence, the model learning to open each answer with it."""
    tok = build_char_tokenizer()
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tok.encode("5")[0] == bos  # this tokenizer adds BOS, as Llama's do
    (sft,) = sft_trajectories([{"q": "2+3=", "a": "5"}], tok, "q", "a", chat_template="never")
    assert sft.completion_ids == tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    assert bos not in sft.completion_ids


QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "extra", "eos", "trained"),
    [
        # Llama 3 as first released: the tokenizer's EOS is <|end_of_text|>, the turn ends with <|eot_id|>
        (LLAMA_TEMPLATE, (*LLAMA_TOKENS, "<|end_of_text|>"), "<|end_of_text|>", "19<|eot_id|>"),
        # a Qwen2.5 base model shipping ChatML: EOS <|endoftext|>, the turn ends with <|im_end|> (then "\n")
        (QWEN_TEMPLATE, ("<|endoftext|>",), "<|endoftext|>", "19<|im_end|>"),
        # Qwen3: the template's empty think block before the answer
        (QWEN3_TEMPLATE, (), "<|im_end|>", "<think>\n\n</think>\n\n19<|im_end|>"),
    ],
    ids=["llama3_eos_end_of_text", "qwen25_base", "qwen3"],
)
def test_offline_completions_are_the_templates_assistant_turn(template, extra, eos, trained):
    """walk30: SFT/DPO completions were the text and the tokenizer's EOS, where the template writes another
    end of turn (or a think block): the model learnt to end turns with a token no deployment uses."""
    tok = build_char_tokenizer(extra_tokens=extra)
    tok.chat_template, tok.eos_token = template, eos
    messages = [{"role": "user", "content": "12+7?"}]
    (sft,) = sft_trajectories([{"q": messages, "a": "19"}], tok, "q", "a", chat_template="always")
    assert tok.decode(sft.completion_ids) == trained
    full = tok.apply_chat_template([*messages, {"role": "assistant", "content": "19"}], tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    assert full[: len(sft.prompt_ids) + len(sft.completion_ids)] == sft.prompt_ids + sft.completion_ids
    chosen, rejected = preference_trajectories(
        [{"q": messages, "chosen": "19", "rejected": "20"}], tok, "q", chat_template="always"
    )
    assert chosen.completion_ids == sft.completion_ids and tok.decode(rejected.completion_ids) == trained.replace(
        "19", "20"
    )


THINKING_TEMPLATE = (  # Qwen3's: the answer after the last question opens with its (empty) think block
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
NO_THINKING = {"enable_thinking": False}


def test_chat_template_kwargs_reach_rollouts_evaluation_and_offline_data(tmp_path):
    """data.chat_template_kwargs (Qwen3's enable_thinking) render every prompt of the run."""
    tok = _save_tokenizer(tmp_path / "model", THINKING_TEMPLATE, ("<think>", "</think>"))
    cfg = _config(tmp_path, tmp_path / "model", "data.chat_template_kwargs={enable_thinking: false}")
    expected = set()
    for q in ("What is 2+3?", "What is 1+1?"):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, **NO_THINKING)
        expected.add(tuple(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert all(tok.decode(ids).endswith("<think>\n\n</think>\n\n") for ids in expected)
    check_run(cfg)
    trainer = Trainer.init(cfg)
    try:
        rollout = trainer.backend.rollout_batch(0)
        assert {tuple(t.prompt_ids) for t in rollout.trajectories} == expected
        client = trainer.backend.engine.rollout.client
        seen_ids, generate = [], client.agenerate

        async def arecording(prompt_ids, params, **kwargs):
            seen_ids.append(tuple(prompt_ids))
            return await generate(prompt_ids, params, **kwargs)

        client.agenerate = arecording
        trainer.backend.evaluate()
    finally:
        trainer.shutdown()
    assert set(seen_ids) == expected
    (sft,) = sft_trajectories(
        [{"q": "What is 1+1?", "a": "2"}], tok, "q", "a", chat_template="always", chat_template_kwargs=NO_THINKING
    )
    assert tuple(sft.prompt_ids) in expected and tok.decode(sft.completion_ids) == "2<|im_end|>"


def test_chat_template_kwargs_need_a_template(tmp_path):
    model = tmp_path / "model"
    _save_tokenizer(model, None)
    with pytest.raises(ConfigError, match="data.chat_template_kwargs is set but prompts are not wrapped"):
        check_run(_config(tmp_path, model, "data.chat_template_kwargs={enable_thinking: false}"))
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: needs a chat template"):
        _config(tmp_path, model, "data.chat_template=never", "data.chat_template_kwargs={enable_thinking: false}")


def test_server_chat_route_takes_chat_template_kwargs(tmp_path):
    tok = _save_tokenizer(tmp_path / "model", THINKING_TEMPLATE, ("<think>", "</think>"))
    engine, tokenizer = build_engine(
        str(tmp_path / "model"), device="cpu", num_blocks=64, block_size=8, max_model_len=128
    )
    user = [{"role": "user", "content": "What is 2+3?"}]
    body = {"model": "tiny", "messages": user, "max_tokens": 2, "chat_template_kwargs": NO_THINKING}
    with serving(create_app(engine, tokenizer=tokenizer, model_name="tiny")) as base:
        res = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    expected = render_prompt(tok, user, chat_template="always", chat_template_kwargs=NO_THINKING)
    assert res["choices"][0]["prompt_token_ids"] == expected and tok.decode(expected).endswith("</think>\n\n")


def test_a_template_that_rewrites_the_answer_trains_the_datas_text(caplog):
    """walk32: DeepSeek-R1's template keeps only what follows </think> of an assistant turn: SFT on a reasoning
    trace trained the final answer alone. The data's text is trained then (its text and EOS), with a warning."""
    import logging

    from areno.data import prompts

    tok = r1_tokenizer()
    prompts._WARNED.discard("render_completion")
    answer = "<think>\n1+1 is 2\n</think>\n2"
    with caplog.at_level(logging.WARNING, logger="areno.data.prompts"):
        (sft,) = sft_trajectories([{"q": "1+1=", "a": answer}], tok, "q", "a", chat_template="always")
    assert tok.decode(sft.completion_ids) == answer + "</s>"
    assert "leaves out some of the answer's text" in caplog.text
