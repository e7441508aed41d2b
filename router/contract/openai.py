"""OpenAI-compatible wire messages: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

What agentic RL loops send through an OpenAI client, as vLLM's and SGLang's OpenAI servers
accept it: OpenAI's fields (``prompt`` as a string, strings, token ids or lists of token ids;
``messages``; ``max_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``n``, ``logprobs``, ``top_logprobs``, ``echo``, ``stream``, ``stream_options``) and
the sampling extras vLLM and SGLang add (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``chat_template_kwargs``, ``add_generation_prompt``, ``rid``).

Types are coerced as vLLM's and SGLang's OpenAI servers coerce them (pydantic's lax mode, as
everywhere in this contract). Unknown fields are accepted and ignored (OpenAI
clients send more than a sampler needs), but known knobs this worker does not implement
(penalties, ``logit_bias``, ``best_of``, ``suffix``, a structured ``response_format``,
``continue_final_message``, a forced ``tool_choice``) are refused unless they hold their neutral
value, so a trainer never gets another distribution than it asked for.

Answers carry ``weight_version`` at the top level and in ``metadata`` (SGLang's place for it):
the weights the sample was produced with. The router forwards these bodies byte for byte; it
uses the models here for its route table. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from router.contract.base import MAX_ITEMS, Label, Text, WireRequest, WireResponse
from router.contract.generate import Seed, WeightVersionSpan

#: The most top log-probabilities one position may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: The most choices one request may ask for per prompt.
MAX_N = 128
#: What a token's log-probability is clamped to (vLLM's floor): JSON has no ``-Infinity``.
LOGPROB_FLOOR = -9999.0
#: The ``finish_reason`` values an answer carries.
FinishReasonName = Literal["stop", "length", "abort"]

TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(max_length=MAX_ITEMS)]
StopField = Text | Annotated[list[Text], Field(max_length=MAX_ITEMS)] | None


class StreamOptions(WireRequest):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class OpenAIRequest(WireRequest):
    """Fields both generation routes share."""

    model: Label | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: StopField = None
    stop_token_ids: TokenIds | None = None
    seed: Seed | None = None
    min_tokens: int = Field(0, ge=0, le=2**31)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = False
    user: Label | None = None
    #: A request id (SGLang's field; the router sets it to abort by it); choices of a request with
    #: several get ``rid-0``, ``rid-1``, ... in the order of ``choices``.
    rid: Label | None = None
    # Accepted for compatibility; only their neutral values are allowed.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def _check_sampling(self) -> None:
        neutral: dict[str, tuple[Any, ...]] = {
            "frequency_penalty": (None, 0.0),
            "presence_penalty": (None, 0.0),
            "repetition_penalty": (None, 1.0),
        }
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by this worker")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this worker")
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise ValueError("best_of is not supported by this worker (only best_of == n)")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported by this worker")
        if self.min_tokens and self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if any(s == "" for s in self.stop_strings()):
            raise ValueError("stop strings must be non-empty")

    @property
    def max_new_tokens(self) -> int | None:
        """The caller's bound on new tokens; ``None``: whatever the context leaves."""
        raise NotImplementedError

    @property
    def choices_per_prompt(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def effective_temperature(self) -> float:
        return self.temperature if self.temperature is not None else 1.0

    @property
    def effective_top_p(self) -> float:
        return self.top_p if self.top_p is not None else 1.0

    @property
    def effective_top_k(self) -> int:
        """``0`` and ``-1`` both mean top-k is off (vLLM accepts either)."""
        return -1 if self.top_k is None or self.top_k == 0 else self.top_k

    @property
    def effective_min_p(self) -> float:
        return self.min_p if self.min_p is not None else 0.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_ITEMS)]
    | Annotated[list[Annotated[int, Field(le=2**31)]], Field(min_length=1, max_length=1 << 20)]
    | Annotated[
        list[Annotated[list[Annotated[int, Field(le=2**31)]], Field(max_length=1 << 20)]],
        Field(min_length=1, max_length=MAX_ITEMS),
    ]
)


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``: one or more prompts, ``n`` choices each.

    ``max_tokens`` defaults to 16 as OpenAI's does; ``null`` means whatever the context leaves.
    ``logprobs`` asks for that many top log-probabilities per position (0: the sampled token's only).
    """

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=2**31)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        self._check_sampling()
        if self.suffix:
            raise ValueError("suffix is not supported by this worker")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt log-probabilities are not computed)")
        choices = len(self.prompts()) * self.choices_per_prompt
        if choices > MAX_ITEMS:
            raise ValueError(f"{choices} choices asked for (prompts × n); at most {MAX_ITEMS} per call")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str] | list[list[int]]:
        """Every prompt: texts, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [[t for t in p if isinstance(t, int)]]
        if all(isinstance(t, str) for t in p):
            return [t for t in p if isinstance(t, str)]
        return [list(t) for t in p if isinstance(t, list)]


class TextPart(WireRequest):
    """One part of a message's ``content`` list; only text parts are served."""

    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(WireRequest):
    """One message of ``messages``. Extra fields (``reasoning_content``, ...) reach the chat template."""

    role: ChatRole
    content: str | Annotated[list[TextPart], Field(max_length=MAX_ITEMS)] | None = None
    name: Label | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)] | None = None
    tool_call_id: Label | None = None

    def template_view(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines, as vLLM does."""
        view = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            view["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            view["content"] = None
        return view


#: Names the chat template receives from the worker; ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatCompletionRequest(OpenAIRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat template.

    ``max_completion_tokens`` wins over ``max_tokens``; with neither, generation runs until the
    context is full or a stop condition. ``logprobs`` is a bool here, ``top_logprobs`` the count.
    ``tools`` are handed to the template (tool calls are not parsed out of the answer).
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)]
    max_tokens: int | None = Field(None, ge=0, le=2**31)
    max_completion_tokens: int | None = Field(None, ge=0, le=2**31)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        self._check_sampling()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice other than 'none' or 'auto' is not supported by this worker")
        if self.continue_final_message:
            raise ValueError("continue_final_message is not supported by this worker")
        reserved = sorted(RESERVED_TEMPLATE_NAMES & set(self.chat_template_kwargs or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_num(self) -> int:
        return self.top_logprobs or 0


# -- answers ------------------------------------------------------------------------------------
# The worker sends the keys it sets (``model_dump(mode="json", exclude_unset=True)``): a field it
# leaves out is absent, not null, as in vLLM's answers (``token_ids`` only with ``return_token_ids``).


class PromptTokensDetails(WireResponse):
    cached_tokens: int | None = None


class Usage(WireResponse):
    """Token counts: prompts once each, completions over every choice."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: vLLM's token answer carries it (``null``); the OpenAI routes leave it out.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(WireResponse):
    """OpenAI's legacy completion log-probabilities (one entry per generated token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(WireResponse):
    """One choice; ``token_ids`` and ``prompt_token_ids`` only with ``return_token_ids``."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    #: The stop string or stop token that ended the choice (``None`` for EOS), as vLLM reports it.
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    #: The weights that sampled each span of this choice's tokens, and its first token's (omni-worker).
    weight_versions: list[WeightVersionSpan] | None = None
    first_token_weight_version: str | None = None


class ResponseMetadata(WireResponse):
    """``metadata`` of an answer: the weights that produced it (a flat string map, as OpenAI's schema
    wants: a LoRA adapter's version is written as text)."""

    weight_version: str
    lora_name: str | None = None
    lora_version: str | None = None


class CompletionResponse(WireResponse):
    """``/v1/completions`` answer (``object`` ``text_completion``). Streamed, each chunk has this shape
    too (as OpenAI streams ``Completion`` objects): a choice's new text, its ``stop_reason`` only on
    its last chunk, ``usage`` null on every chunk with ``include_usage`` and set on a last chunk
    without choices; a choice's first chunk echoing the prompt carries no weight versions yet."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    weight_version: str
    metadata: ResponseMetadata | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(WireResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(WireResponse):
    content: list[TokenLogprob] | None = None
    refusal: str | None = None


class ChatResponseMessage(WireResponse):
    role: str = "assistant"
    content: str | None = None


class ChoiceTail(WireResponse):
    """The fields a chat choice and a streamed chunk's choice share, after their ``message`` / ``delta``.

    A choice class lists it first among its bases and its own head (``index`` and the message) second:
    pydantic orders fields by the reversed MRO, so the head's come first and the wire order is
    OpenAI's (``index``, ``message``, ``logprobs``, ...) in both."""

    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    #: The weights that sampled each span of the choice's tokens (so far, in a chunk), and its first token's
    #: (omni-worker).
    weight_versions: list[WeightVersionSpan] | None = None
    first_token_weight_version: str | None = None


class _ChatChoiceHead(WireResponse):
    index: int
    message: ChatResponseMessage


# One choice of a chat completion: ``index``, ``message``, then ChoiceTail's fields. (No docstring: it
# would become the choice's description in the OpenAPI document, which has none.)
class ChatChoice(ChoiceTail, _ChatChoiceHead):
    pass


class ChatCompletionResponse(WireResponse):
    """``/v1/chat/completions`` answer (``object`` ``chat.completion``; streamed as
    ``chat.completion.chunk`` objects whose choices carry ``delta`` instead of ``message``)."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    weight_version: str
    metadata: ResponseMetadata | None = None
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(WireResponse):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "omni-router"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's and SGLang's field); None for the base itself."""
    max_model_len: int | None = None


class ModelList(WireResponse):
    """``GET /v1/models``."""

    object: str = "list"
    data: list[ModelCard]
