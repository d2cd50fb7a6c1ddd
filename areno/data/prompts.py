"""The one place a dataset prompt becomes token ids: the rollout workflows, evaluation, offline
(SFT) data and the rollout server's chat route all call :func:`render_prompt`, so one prompt is
tokenized identically everywhere.

A prompt is a string or a list of ``{"role", "content"}`` messages (TRL's conversational format).
``chat_template`` says whether the tokenizer's chat template wraps it:

- ``auto``: when the tokenizer has a template (as TRL and AReaL's examples do), except areno's
  character tokenizer, whose tiny models are trained from scratch on raw prompts (its template
  serves the chat route only);
- ``always``: the template (a tokenizer without one is a :class:`ConfigError`, see
  :func:`check_chat_template`);
- ``never``: ``tokenizer.encode(prompt)`` of a string prompt, as before templates existed.

With the template, a string prompt is one user message, ``system_prompt`` (when set, and the
messages do not open with a system message) is prepended as a system message, and the ids are
``apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from areno.data.messages import completion_text, message_list_problem
from areno.data.tokenizer import is_char_tokenizer_object
from areno.errors import ConfigError, DataError

CHAT_TEMPLATE_MODES = ("auto", "always", "never")
logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def uses_template(tokenizer: Any, chat_template: str) -> bool:
    """Whether prompts are wrapped in ``tokenizer``'s chat template under mode ``chat_template``."""
    template = getattr(tokenizer, "chat_template", None)
    if chat_template == "never":
        return False
    if chat_template == "always":
        return True
    return template is not None and not is_char_tokenizer_object(tokenizer)


def check_chat_template(
    tokenizer: Any, chat_template: str, system_prompt: str | None, chat_template_kwargs: dict | None = None
) -> None:
    """The start-up check: ``always`` (or a ``system_prompt``, or ``chat_template_kwargs``) needs a tokenizer
    with a template, which renders a probe prompt with them."""
    if chat_template == "always" and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "data.chat_template=always but the model's tokenizer has no chat template: "
            "use data.chat_template=never (or auto) or a tokenizer whose tokenizer_config.json has one"
        )
    if system_prompt is not None and not uses_template(tokenizer, chat_template):
        raise ConfigError(
            f"data.system_prompt is set but prompts are not wrapped in a chat template (data.chat_template="
            f"{chat_template}, the tokenizer {'has' if tokenizer.chat_template else 'has no'} template): "
            "unset data.system_prompt or use data.chat_template=always with a templated tokenizer"
        )
    if chat_template_kwargs and not uses_template(tokenizer, chat_template):
        raise ConfigError(
            f"data.chat_template_kwargs is set but prompts are not wrapped in a chat template (data.chat_template="
            f"{chat_template}): unset it or use data.chat_template=always with a templated tokenizer"
        )
    if uses_template(tokenizer, chat_template):  # a template that raises would fail every rollout later
        try:
            render_prompt(
                tokenizer,
                "1+1=",
                chat_template=chat_template,
                system_prompt=system_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or whatever the template raises
            what = "with data.system_prompt's system message" if system_prompt is not None else "on a user message"
            fix = (
                "unset data.system_prompt and put the instruction in the prompts"
                if system_prompt is not None
                else "fix the template or use data.chat_template=never"
            )
            raise ConfigError(f"the model's chat template fails {what} ({type(exc).__name__}: {exc}): {fix}") from None


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    *,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a dataset prompt (a string or a message list); see the module docstring."""
    if not uses_template(tokenizer, chat_template):
        if not isinstance(prompt, str):
            raise DataError(
                f"a message-list prompt ({prompt!r:.80}) needs a chat template, but data.chat_template="
                f"{chat_template} leaves prompts untemplated: use data.chat_template=always with a templated tokenizer"
            )
        return list(tokenizer.encode(prompt))
    return apply_template(tokenizer, prompt_messages(prompt, system_prompt), **(chat_template_kwargs or {}))


def prompt_messages(prompt: str | list[dict], system_prompt: str | None = None) -> list[dict]:
    """A dataset prompt as the chat messages the template renders: a string as one user message, a
    message list checked and copied; ``system_prompt`` first unless the messages open with one."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        problem = message_list_problem(prompt)
        if problem is not None:
            raise DataError(f"prompt {prompt!r:.80}: {problem}")
        messages = [dict(m) for m in prompt]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render_completion(
    tokenizer: Any,
    prompt: str | list[dict],
    completion: Any,
    prompt_ids: list[int],
    *,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a dataset's reference completion after ``prompt_ids`` (``render_prompt``'s): with the
    chat template, what the template writes for the assistant turn (its end-of-turn token, Qwen3's empty
    think block), as TRL's SFT takes it, without the whitespace it puts after the end of the turn;
    untemplated, or where the template's render does not extend the prompt's, the text and the EOS."""
    text = completion_text(completion)
    if not uses_template(tokenizer, chat_template):
        return _plain_completion(tokenizer, text)
    messages = prompt_messages(prompt, system_prompt)
    turns = list(completion) if isinstance(completion, list) else [{"role": "assistant", "content": text}]
    full = apply_template(tokenizer, [*messages, *turns], generation=False, **(chat_template_kwargs or {}))
    ids = full[len(prompt_ids) :]
    rendered = tokenizer.decode(ids)
    # a template may rewrite the answer (DeepSeek-R1's keeps what follows </think>): the data's text is trained
    kept = all(m["content"].strip() in rendered for m in turns)
    if full[: len(prompt_ids)] != list(prompt_ids) or not ids or not kept:
        if "render_completion" not in _WARNED:
            _WARNED.add("render_completion")
            logger.warning(
                "the chat template's render of a reference answer %s: offline completions are the answer's text "
                "and the tokenizer's EOS where it does (warned once)",
                "does not extend the prompt's" if ids and kept else "leaves out some of the answer's text",
            )
        return _plain_completion(tokenizer, text)
    while len(ids) > 1 and not tokenizer.decode(ids[-1:]).strip():  # Qwen's "\n" after <|im_end|>
        ids.pop()
    special = set(getattr(tokenizer, "all_special_ids", ())) | {tokenizer.eos_token_id}
    if ids[-1] not in special:  # a template that ends the turn with no token: the model must still stop
        ids.append(tokenizer.eos_token_id)
    return ids


def _plain_completion(tokenizer: Any, text: str) -> list[int]:
    """An untemplated completion: the text's ids and the EOS (encoded only where used: the templated render
    already encodes the answer once, with the prompt)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def apply_template(
    tokenizer: Any, messages: list[dict], *, generation: bool = True, **template_kwargs: Any
) -> list[int]:
    """``apply_chat_template(messages, add_generation_prompt=generation, **template_kwargs)`` as a list of ids
    (transformers 5 returns a ``BatchEncoding``, 4 a list); ``template_kwargs`` are the template's own
    variables (Qwen3's ``enable_thinking``)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, **template_kwargs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
