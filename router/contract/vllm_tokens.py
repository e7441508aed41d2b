"""vLLM's token routes: ``POST /inference/v1/generate`` (tokens in, tokens out), ``/tokenize``, ``/detokenize``.

Field for field as vLLM 0.31 serves them (``vllm/entrypoints/scale_out/token_in_token_out`` and
``vllm/entrypoints/serve/tokenize``), what SkyRL's ``RemoteInferenceClient`` and TRL post:

* ``/inference/v1/generate``: ``{"token_ids": [...], "sampling_params": {...vLLM SamplingParams},
  "request_id"?, "model"?, "stream"?, "stream_options"?, "return_token_ids"?, "cache_salt"?}`` →
  ``{"request_id": "generate-tokens-<id>", "model", "created", "choices": [{"index", "logprobs":
  {"content": [{"token": "token_id:N", "logprob", "bytes", "top_logprobs"}]} | null, "finish_reason",
  "token_ids"}], "usage", "prompt_token_ids" (with ``return_token_ids``), ...}``. ``max_tokens`` left
  out means whatever the context leaves (vLLM's server default), not the dataclass's 16.
  ``logprobs: k`` gives each token's log-probability and a ``top_logprobs`` list of ``max(k, 1)``
  entries, the sampled token first, as vLLM lists them.
* ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or the chat form ``{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false}`` → ``{"count", "max_model_len",
  "tokens", "token_strs"}``; ``/detokenize``: ``{"tokens": [...]}`` → ``{"prompt": str}``.

Inputs this worker cannot honour are refused (400), never ignored: multimodal ``features`` and
``content_parts`` (the worker serves text-only models), prompt log-probabilities, structured
outputs, penalties other than neutral, ``logit_bias``, ``allowed_token_ids``, ``bad_words``, a
non-zero ``priority``, disaggregated-serving transfer parameters. ``model`` is not checked (the
worker serves its one model), as on the OpenAI routes. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from router.contract.base import MAX_ITEMS, Label, WireRequest, WireResponse
from router.contract.generate import Seed, WeightVersionSpan
from router.contract.openai import (
    MAX_LOGPROBS,
    MAX_N,
    ChatMessage,
    StopField,
    StreamOptions,
    TokenIds,
    TokenLogprob,
    Usage,
)

GENERATE_PATH = "/inference/v1/generate"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
#: vLLM's header that names a request (it wins over the body's ``request_id``).
REQUEST_ID_HEADER = "X-Request-Id"
#: The prefix vLLM gives the id of a token-in/token-out request (``generate-tokens-<request_id>``):
#: the id its answer carries and ``/abort_requests`` takes.
REQUEST_ID_PREFIX = "generate-tokens-"
#: Below this a temperature means greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
#: The longest prompt one request may carry.
MAX_PROMPT_TOKENS = 1 << 20

PromptIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]

#: vLLM ``SamplingParams`` fields this worker does not implement, with the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "prompt_logprobs": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "logprob_token_ids": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "trace_decode_token_ids": (None,),
}


class VllmSamplingParams(WireRequest):
    """vLLM's ``SamplingParams`` as a request body carries it, with vLLM's checks (``_verify_args``).

    ``temperature`` below 1e-5 is greedy; ``top_k`` 0 or -1 is off; ``seed`` -1 is no seed; ``n``
    choices sample with ``seed``, ``seed + 1``, ... (as the OpenAI routes do). ``output_kind``,
    ``detokenize``, ``skip_special_tokens`` and the like are accepted: they shape text this route
    does not return. ``stop`` strings end generation as on the other routes (the token that
    completes one is kept in ``token_ids``, as vLLM keeps it)."""

    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: StopField = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    #: Left out: what the context leaves (vLLM's server default); ``null`` too.
    max_tokens: int | None = Field(None, ge=1, le=2**31)
    min_tokens: int = Field(0, ge=0, le=2**31)
    #: Top log-probabilities per generated token (0: the sampled token's only); at most vLLM's default
    #: ``max_logprobs`` (20), so the whole vocabulary (-1) is refused as vLLM refuses it by default.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = Field(0, ge=0, le=2)
    stream_interval: int | None = Field(None, ge=1)
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_ITEMS)] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    trace_decode_token_ids: list[int] | None = None

    @field_validator("seed", mode="after")
    @classmethod
    def _no_seed(cls, seed: int | None) -> int | None:
        return None if seed == -1 else seed

    @model_validator(mode="after")
    def _check(self) -> VllmSamplingParams:
        for name, neutral in _NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise ValueError(f"sampling_params.{name}={getattr(self, name)!r} is not supported by this worker")
        if self.logit_bias:
            raise ValueError("sampling_params.logit_bias is not supported by this worker")
        if self.bad_words:
            raise ValueError("sampling_params.bad_words is not supported by this worker")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        stops = self.stop_strings()
        if any(not s for s in stops):
            raise ValueError("stop cannot contain an empty string.")
        if stops and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        return self

    # The sampling view the worker's OpenAI machinery plans choices from.
    @property
    def max_new_tokens(self) -> int | None:
        """``None``: whatever the context leaves."""
        return self.max_tokens

    @property
    def choices_per_prompt(self) -> int:
        return self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.greedy else self.top_p

    @property
    def effective_top_k(self) -> int:
        return -1 if self.greedy or self.top_k in (0, -1) else self.top_k

    @property
    def effective_min_p(self) -> float:
        return 0.0 if self.greedy else self.min_p

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TokensGenerateRequest(WireRequest):
    """``POST /inference/v1/generate``: vLLM's ``GenerateRequest``."""

    request_id: Label | None = None
    """The caller's id; the answer's is ``generate-tokens-<id>`` (a new id when none is given; an
    ``X-Request-Id`` header wins over it, as in vLLM)."""
    token_ids: PromptIds
    sampling_params: VllmSamplingParams
    model: Label | None = None
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    token_offsets: list[Any] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokensGenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        if self.features is not None or self.content_parts:
            raise ValueError(
                "multimodal input (features, content_parts) is not supported: this worker serves text-only models"
            )
        if self.priority != 0:
            raise ValueError("priority scheduling is not enabled on this worker (priority must be 0)")
        for name in ("kv_transfer_params", "ec_transfer_params"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} (disaggregated serving) is not supported by this worker")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.continuous_usage_stats)


class TokensLogprobs(WireResponse):
    """vLLM's ``ChatCompletionLogProbs`` of a token answer: ``token`` is ``"token_id:<id>"``."""

    content: list[TokenLogprob] | None = None


class TokensChoice(WireResponse):
    """One choice (each of its chunks, streamed: the new ``token_ids``, ``finish_reason`` on the last)."""

    index: int
    logprobs: TokensLogprobs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    #: The weights that sampled each span of the choice's tokens, and its first token's (omni-worker).
    weight_versions: list[WeightVersionSpan] | None = None
    first_token_weight_version: str | None = None


class TokensGenerateResponse(WireResponse):
    """vLLM's ``GenerateResponse`` (every field sent, ``null`` when absent, as its ``model_dump``
    writes them), plus this project's ``weight_version`` (the weights that sampled its newest token).
    Streamed, each ``data:`` event is a :class:`TokensStreamResponse`, then ``data: [DONE]``."""

    request_id: str
    model: str | None = None
    created: int | None = None
    weight_version: str | None = None
    choices: list[TokensChoice]
    usage: Usage | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class TokensStreamResponse(WireResponse):
    """One event of a streamed token answer: vLLM's ``GenerateStreamResponse`` (``request_id``, the
    choices' new ``token_ids``, ``usage``: null, or each choice's counts so far with
    ``continuous_usage_stats``; ``prompt_token_ids`` on the first event with ``return_token_ids``),
    plus ``weight_version``. With ``include_usage`` a last event without choices carries the counts."""

    request_id: str
    weight_version: str | None = None
    choices: list[TokensChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class TokenizeRequest(WireRequest):
    """``POST /tokenize``: vLLM's completion form (``prompt``) or its chat form (``messages``, rendered
    with the checkpoint's chat template); exactly one of them. ``add_special_tokens`` defaults to true
    for a prompt and false for messages (the template holds them), as in vLLM."""

    model: Label | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None:
            if self.continue_final_message and self.add_generation_prompt:
                raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
            if self.continue_final_message:
                raise ValueError("continue_final_message is not supported by this worker")
            if self.chat_template is not None:
                raise ValueError(
                    "a request's own chat_template is not accepted (vLLM's default): the checkpoint's is used"
                )
        return self

    @property
    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class TokenizeResponse(WireResponse):
    """vLLM's answer; ``token_strs`` only with ``return_token_strs``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(WireRequest):
    """``POST /detokenize``: ids of the vocabulary (others are a 400)."""

    model: Label | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=2**63 - 1)]], Field(max_length=MAX_PROMPT_TOKENS)]


class DetokenizeResponse(WireResponse):
    prompt: str
