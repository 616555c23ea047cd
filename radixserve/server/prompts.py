"""Chat messages → prompt token ids, and how many of them belong to the system prompt."""

from __future__ import annotations

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatMessage

_SYSTEM_ROLES = ("system", "developer")


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage]) -> tuple[list[int], int]:
    """Renders `messages` with the tokenizer's chat template and a generation prompt.

    Returns the prompt's token ids and the number of leading tokens that the system
    message(s) alone render to (0 without a leading system message): the part of the prompt
    shared by every conversation with the same system prompt.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions instead.",
                       param="messages", code="no_chat_template")
    conversation = [_as_dict(message, i) for i, message in enumerate(messages)]
    prompt_ids = _encode(tokenizer, conversation, add_generation_prompt=True)
    num_system = 0
    while num_system < len(conversation) and conversation[num_system]["role"] == "system":
        num_system += 1
    if num_system == 0:
        return prompt_ids, 0
    system_ids = _encode(tokenizer, conversation[:num_system], add_generation_prompt=False)
    # Templates may close the system block differently when nothing follows it, and BPE may
    # merge across the boundary: only the tokens both renderings share count as the prefix.
    shared = 0
    for a, b in zip(system_ids, prompt_ids):
        if a != b:
            break
        shared += 1
    return prompt_ids, shared


def _as_dict(message: ChatMessage, position: int) -> dict[str, str]:
    if message.content is None and message.role != "assistant":
        raise APIError(400, f"messages[{position}].content is required for role {message.role!r}",
                       param=f"messages[{position}].content", code="missing_field")
    # OpenAI's "developer" role is the newer name of "system"; templates know only the latter.
    role = "system" if message.role in _SYSTEM_ROLES else message.role
    return {"role": role, "content": message.text()}


def _encode(tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]], *,
            add_generation_prompt: bool) -> list[int]:
    # Render to text, then encode without special tokens: the template already wrote BOS and
    # friends, and transformers 5.x returns a BatchEncoding from tokenize=True.
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:  # templates reject some conversations (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages",
                       code="invalid_messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))
