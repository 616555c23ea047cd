"""msgspec schemas of the OpenAI-compatible API: requests (validated on decode) and responses.

Ranges are declared on the fields, so a bad value fails decoding with a message that names
its path (`$.messages[0].role`); errors.error_from_decode turns that into the error's `param`.
Unknown request fields are ignored, as OpenAI-compatible servers commonly do; the known
OpenAI fields radixserve cannot honour are declared and refused when set (see app checks).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

MAX_ID_CHARS = 256  # model, user, cache_salt, session_id, message name (docs/server.md)
MAX_LOGIT_BIAS = 1024  # entries; like stop strings (engine/params.py), capped in the schema
MIN_PRIORITY, MAX_PRIORITY = -100, 100  # a request's scheduling priority (docs/server.md)

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 and 0 both switch top-k off (vLLM and HF conventions)
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]
RetentionPriority = Annotated[int, Meta(ge=0, le=100)]
SchedulingPriority = Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
Duration = Annotated[float, Meta(gt=0.0)]
Identifier = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Name = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
# No NUL: a namespace's published id hashes its parts joined by NUL (page_hash.namespace_id), so
# an admin's salt "acme\x00x" would name tenant acme's namespace of salt "x".
Salt = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, pattern="^[^\x00]*$")]
TokenId = Annotated[int, Meta(ge=0)]
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]

Role = Literal["system", "developer", "user", "assistant", "tool"]


# ---------------------------------------------------------------- requests


class StreamOptions(Struct, kw_only=True):
    """`stream_options`: include_usage adds a last chunk carrying `usage`."""

    include_usage: bool = False


class TextPart(Struct, tag_field="type", tag="text"):
    """A text content part: {"type": "text", "text": ...}."""

    text: str


class RefusalPart(Struct, tag_field="type", tag="refusal"):
    """An assistant's refusal content part: {"type": "refusal", "refusal": ...} (an earlier
    OpenAI reply sent back in the history); the template gets its text."""

    refusal: str


class FunctionCall(Struct, kw_only=True):
    """The function a tool call invokes: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(Struct, kw_only=True):
    """One tool call of an assistant message (in a request's history or a response)."""

    id: Identifier  # a tool message answers it by this id: an empty one answers nothing
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Struct, kw_only=True):
    """A function the model may call: `parameters` is a JSON Schema of its arguments."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    """An entry of `tools`: only function tools exist."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True):
    """The `function` of a named tool_choice."""

    name: str


class NamedToolChoice(Struct, kw_only=True):
    """`tool_choice` {"type": "function", "function": {"name": ...}}: call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Struct, kw_only=True):
    """One message of a conversation; content is text or a list of text parts. An assistant
    message may carry `tool_calls` (then content may be null); a tool message answers the call
    named by `tool_call_id`."""

    role: Role
    content: str | list[TextPart | RefusalPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Identifier | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)


class JSONSchemaFormat(Struct, kw_only=True):
    """`response_format.json_schema`: the schema the output must match (`strict` is accepted
    either way: the output is always constrained to the schema)."""

    name: Name = "response"
    description: str | None = None
    schema: dict | bool | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    """`response_format`: "text" (the default), "json_object" (any JSON object) or
    "json_schema" (a value valid under `json_schema.schema`)."""

    type: Name
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's `structured_outputs` extension: one of a schema, a regex, choices or a grammar."""

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Fields whose default is not null: a null sent for them means the default.
_NULL_IS_DEFAULT: dict[str, object] = {"ignore_eos": False, "return_tokens_as_token_ids": False, "priority": 0,
                                       "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False}


class GenerationRequest(Struct, kw_only=True):
    """Fields shared by chat and completions requests, OpenAI's and radixserve's own."""

    model: Name | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: NumChoices | None = None
    best_of: NumChoices | None = None  # accepted only when it asks for no more than n
    user: Name | None = None
    stream: bool | None = False  # null (OpenAI's "boolean or null"): false, as for the others
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # OpenAI fields with no implementation here: accepted at their neutral value only.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM-compatible extensions.
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = False
    # Structured-output extensions as vLLM names them (also as one `structured_outputs` object).
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # radixserve extensions: scheduling, cache isolation and retention.
    priority: SchedulingPriority | None = 0  # higher first; across tenants only for an admin key
    cache_salt: Salt | None = None
    retention_priority: RetentionPriority | None = None
    retention_duration_s: Duration | None = None
    session_id: Identifier | None = None
    # Beam search (extension): the n best of beam_width beams (beam_width defaults to n).
    use_beam_search: bool | None = False
    beam_width: NumChoices | None = None
    length_penalty: float | None = 1.0
    early_stopping: bool | Literal["never"] | None = False

    def __post_init__(self) -> None:
        # null is each optional field's default (docs/server.md), these extensions' too
        for name, default in _NULL_IS_DEFAULT.items():
            if getattr(self, name) is None:
                setattr(self, name, default)


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    system_retention_priority: RetentionPriority | None = None
    system_retention_duration_s: Duration | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # null: true
    # OpenAI's deprecated forms of tools and tool_choice: refused (tools.plan_tools), not
    # ignored (an old agent would get text and never know why its functions went uncalled)
    functions: list[object] | None = None
    function_call: object = None


class CompletionRequest(GenerationRequest, kw_only=True):
    """POST /v1/completions; the prompt is text, a list of token ids, or a batch of either
    (a list of strings or of token-id lists: see translate.completion_prompts)."""

    prompt: str | Annotated[list[TokenId | str | TokenIds], Meta(min_length=1)]
    logprobs: NumLogprobs | None = None
    echo: bool | None = False
    suffix: str | None = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(Struct, kw_only=True):
    """How many prompt tokens came from the prefix cache."""

    cached_tokens: int


class Usage(Struct, kw_only=True):
    """Token counts of a request; completion_tokens sums over all choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct, kw_only=True):
    """One alternative token of a chat logprob entry."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    """A generated token's logprob and its top alternatives (chat format)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    """`choices[i].logprobs` of a chat response or chunk."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(Struct, kw_only=True):
    """`choices[i].logprobs` of a completions response or chunk (legacy format)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(Struct, kw_only=True):
    """The message of a non-streaming chat choice; content is null when it only calls tools."""

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    """One choice of a `chat.completion`."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct, kw_only=True):
    """A non-streaming chat response."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(Struct, kw_only=True, omit_defaults=True):
    """A tool call's function in a chunk: the name once, then fragments of the arguments."""

    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    """A fragment of the `index`-th tool call of a choice (id and type come with its name)."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: DeltaFunctionCall


class DeltaMessage(Struct, kw_only=True):
    """What a chat chunk adds to its choice; unset fields are left out of the JSON."""

    role: str | UnsetType = UNSET
    content: str | None | UnsetType = UNSET  # (null: the opening of a reply that is calls)
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct, kw_only=True):
    """One choice of a `chat.completion.chunk`."""

    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    """One Server-Sent Event of a streaming chat response."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class CompletionChoice(Struct, kw_only=True):
    """One choice of a `text_completion` (whole or chunk)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct, kw_only=True):
    """A completions response, or one chunk of a streaming one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    """One entry of GET /v1/models."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "radixserve"
    max_model_len: int


class ModelList(Struct, kw_only=True):
    """GET /v1/models."""

    object: str = "list"
    data: list[ModelCard]


class ErrorBody(Struct, kw_only=True):
    """The inside of an error response; `param` names the request field at fault."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, kw_only=True):
    """{"error": {...}}, the body of every 4xx/5xx answer."""

    error: ErrorBody

