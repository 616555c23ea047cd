"""A validated API request → the arguments of AsyncEngine.generate.

Everything msgspec cannot check on decode is checked here, and every failure is an APIError
that names the request field at fault.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import EllipsisType, MappingProxyType
from typing import Any

from radixserve import Retention, SamplingParams
from radixserve.grammar import GrammarSpec
from radixserve.server.errors import APIError, error_from_value_error
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from radixserve.server.structured import requested_grammar
from radixserve.server.tools import AutoCalls
from radixserve.server.work_limit import WorkLimit

# Completions default to OpenAI's 16 new tokens; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
SamplingDefaults = Mapping[str, float | int]  # Engine.sampling_defaults: the checkpoint's recommendations
NO_DEFAULTS: SamplingDefaults = MappingProxyType({})
MAX_BATCH_PROMPTS = 64  # prompts in one completions request (docs/server.md)
RequestedGrammar = tuple[GrammarSpec, str] | None  # a constraint and the field it came from


@dataclass
class EngineCall:
    """Everything AsyncEngine.generate needs for one request."""

    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    retention: Retention | None
    prefix_retention: tuple[int, Retention] | None
    session_id: str | None
    tenant: str | None = None  # set by the server from the request's API key
    admin: bool = False  # sent with an admin key (Request.admin)
    client: Hashable = None  # whom the engine's fair share counts it as (Request.client): share_key
    grammar_param: str | None = None  # the request field params.grammar came from
    # params.grammar compiled (the server's _compile_grammar), held until the engine has the
    # request: the engine finds it then, whatever the grammar cache evicted meanwhile.
    compiled_grammar: Any = None


def chat_call(request: ChatCompletionRequest, prompt_ids: list[int], system_tokens: int,
              max_context_len: int, max_sequence_len: int | None = None,
              defaults: SamplingDefaults = NO_DEFAULTS,
              tool_grammar: tuple[GrammarSpec, str] | None = None, work_limit: WorkLimit | None = None,
              auto_calls: AutoCalls | None = None) -> EngineCall:
    """The engine call for a chat request whose messages rendered to `prompt_ids`; sampling
    fields it leaves unset take `defaults` (the model's recommendations) first;
    `tool_grammar` is the constraint its tool_choice puts on the reply (tools.plan_tools);
    `work_limit` bounds its samples x max_tokens (work_limit.py); `auto_calls`, under
    tool_choice "auto", constrain the reply with the structured output it asks for (either)
    or alone (strict tools), unless it asks for ignore_eos (the end token closes a constrained
    output: such a request's own structured output is refused)."""
    _refuse_unsupported(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs",
                       code="invalid_value")
    requested = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    max_tokens = _fit_context(len(prompt_ids), requested, max_context_len, "messages", param,
                              max_sequence_len=max_sequence_len)
    if work_limit is not None:
        max_tokens = work_limit.bound(max_tokens, requested is not None, _width(request), param)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prefix_retention = None
    system_retention = _retention(request.system_retention_priority,
                                  request.system_retention_duration_s, "system_retention")
    if system_retention is not None and system_tokens > 0:
        prefix_retention = (system_tokens, system_retention)
    grammar = requested_grammar(request)
    if auto_calls is not None and tool_grammar is None and not request.ignore_eos:
        grammar = auto_calls.constraint(grammar) or grammar
    return _call(request, prompt_ids, max_tokens, logprobs, prefix_retention, defaults, tool_grammar, grammar)


def completion_prompts(request: CompletionRequest) -> tuple[list[str | list[int]], bool]:
    """The prompts of a completions request, and whether they came as a batch.

    A string or a list of token ids is one prompt; a list of strings or a list of token-id
    lists is a batch (OpenAI's API), answered with `n` choices per prompt.
    """
    prompt = request.prompt
    if isinstance(prompt, str) or all(isinstance(item, int) for item in prompt):
        return [prompt], False  # type: ignore[list-item]
    if not (all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt)):
        raise APIError(400, "prompt must be a string, a list of token ids, or a batch: a list of strings "
                            "or a list of token-id lists (not a mix)", param="prompt", code="invalid_value")
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}",
                       param="prompt", code="invalid_value")
    return list(prompt), True  # type: ignore[arg-type]


def completion_calls(request: CompletionRequest, prompts_ids: list[list[int]], prompt_params: list[str],
                     max_context_len: int, max_sequence_len: int | None = None,
                     defaults: SamplingDefaults = NO_DEFAULTS, work_limit: WorkLimit | None = None) -> list[EngineCall]:
    """`completion_call` for each prompt of a request's batch, the request's output constraint
    checked once (a JSON Schema's check takes time in proportion to its size)."""
    grammar = requested_grammar(request)
    return [completion_call(request, ids, max_context_len, max_sequence_len, param, defaults, work_limit, grammar)
            for ids, param in zip(prompts_ids, prompt_params)]


def completion_call(request: CompletionRequest, prompt_ids: list[int], max_context_len: int,
                    max_sequence_len: int | None = None, prompt_param: str = "prompt",
                    defaults: SamplingDefaults = NO_DEFAULTS, work_limit: WorkLimit | None = None,
                    grammar: RequestedGrammar | EllipsisType = ...) -> EngineCall:
    """The engine call for a completions request (or one prompt of its batch, named
    `prompt_param` in errors) whose prompt is `prompt_ids`; `work_limit` bounds the whole
    request's prompts x samples x max_tokens (work_limit.py). `grammar`: the request's
    constraint checked already (`...`: check it here)."""
    _refuse_unsupported(request)
    if request.echo:
        raise _unsupported("echo")
    if request.suffix:
        raise _unsupported("suffix")
    if not prompt_ids:
        raise APIError(400, f"{prompt_param} must not be empty", param=prompt_param, code="invalid_value")
    max_tokens = _fit_context(len(prompt_ids), request.max_tokens, max_context_len, prompt_param,
                              "max_tokens", default=COMPLETIONS_DEFAULT_MAX_TOKENS,
                              max_sequence_len=max_sequence_len)
    if work_limit is not None:
        max_tokens = work_limit.bound(max_tokens, request.max_tokens is not None, _width(request), "max_tokens")
    return _call(request, prompt_ids, max_tokens, request.logprobs, None, defaults, requested=grammar)


def _call(request: GenerationRequest, prompt_ids: list[int], max_tokens: int,
          logprobs: int | None, prefix_retention: tuple[int, Retention] | None,
          defaults: SamplingDefaults, tool_grammar: RequestedGrammar = None,
          requested: RequestedGrammar | EllipsisType = ...) -> EngineCall:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    grammar = requested_grammar(request) if requested is ... else requested
    if grammar is not None and tool_grammar is not None:
        raise APIError(400, f"{grammar[1]}: cannot be combined with tool_choice \"required\" or a named "
                            "function (that constrains the reply already)", param=grammar[1], code="invalid_value")
    grammar = grammar or tool_grammar
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_or_default(request.temperature, defaults, "temperature", 1.0),
        top_p=_or_default(request.top_p, defaults, "top_p", 1.0),
        top_k=max(_or_default(request.top_k, defaults, "top_k", 0), 0),
        min_p=request.min_p or 0.0,
        seed=request.seed,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        n=request.n or 1,
        logprobs=logprobs,
        grammar=grammar[0] if grammar else None,
        **_beam_search(request),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise error_from_value_error(exc) from exc
    return EngineCall(
        prompt_ids=prompt_ids,
        params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        retention=_retention(request.retention_priority, request.retention_duration_s, "retention"),
        prefix_retention=prefix_retention,
        session_id=request.session_id,
        grammar_param=grammar[1] if grammar else None,
    )


def _or_default(value: float | int | None, defaults: SamplingDefaults, name: str,
                default: float | int) -> float | int:
    """The request's value, else the model's recommended one, else OpenAI's default."""
    return value if value is not None else defaults.get(name, default)


def _beam_search(request: GenerationRequest) -> dict[str, object]:
    """The SamplingParams fields of the beam-search extension (none without use_beam_search)."""
    if not request.use_beam_search:
        if request.beam_width is not None:
            raise APIError(400, "beam_width needs use_beam_search: true", param="beam_width",
                           code="invalid_value")
        return {}
    return dict(beam_width=request.beam_width or request.n or 1, length_penalty=request.length_penalty,
                early_stopping=request.early_stopping)


def _width(request: GenerationRequest) -> int:
    """Sequences generating per prompt: n samples, or beam_width beams (each generates)."""
    n = request.n or 1
    return max(n, request.beam_width or n) if request.use_beam_search else n


def _fit_context(prompt_len: int, requested: int | None, max_context_len: int,
                 prompt_param: str, max_tokens_param: str, default: int | None = None,
                 max_sequence_len: int | None = None) -> int:
    """max_tokens for the request: as asked, else `default` or what the context leaves (the
    smaller); a 400 when the prompt leaves no room or the request does not fit.

    An unset max_tokens also stays within `max_sequence_len` (the longest sequence the KV pool
    can hold), so a plain chat request on a small pool is not refused for asking too much."""
    room = max_context_len - prompt_len
    if room < 1:
        raise APIError(400, f"The prompt has {prompt_len} tokens; this model's context is "
                            f"{max_context_len} tokens and must leave room for at least one more.",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        if max_sequence_len is not None:
            room = max(1, min(room, max_sequence_len - prompt_len))
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"This model's context is {max_context_len} tokens; you asked for "
                            f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} to "
                            f"generate).", param=max_tokens_param, code="context_length_exceeded")
    return requested


def _retention(priority: int | None, duration_s: float | None, name: str) -> Retention | None:
    if priority is None:
        if duration_s is not None:
            raise APIError(400, f"{name}_duration_s needs {name}_priority",
                           param=f"{name}_duration_s", code="invalid_value")
        return None
    return Retention(priority=priority, duration_s=duration_s)


def _refuse_unsupported(request: GenerationRequest) -> None:
    if request.stream_options is not None and not request.stream:  # as OpenAI: not silently ignored
        raise APIError(400, "stream_options is allowed only with stream: true", param="stream_options",
                       code="invalid_value")
    if request.presence_penalty:
        raise _unsupported("presence_penalty")
    if request.frequency_penalty:
        raise _unsupported("frequency_penalty")
    if request.logit_bias and not all(key.isascii() and key.isdigit() for key in request.logit_bias):
        raise APIError(400, "logit_bias: keys must be token ids (non-negative integers as strings)",
                       param="logit_bias", code="invalid_value")
    if request.logit_bias and any(bias != 0 for bias in request.logit_bias.values()):
        raise _unsupported("logit_bias")
    if request.best_of is not None and request.best_of != (request.n or 1):
        # best_of > n would compute candidates and return the best by log-probability: not
        # implemented, and silently returning n plain samples would misreport the request.
        raise APIError(400, "best_of is supported only equal to n (beam search: use_beam_search with "
                            "beam_width)", param="best_of", code="unsupported_parameter")


def _unsupported(param: str) -> APIError:
    return APIError(400, f"{param} is not supported by radixserve", param=param,
                    code="unsupported_parameter")
