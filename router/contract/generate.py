"""``/generate`` wire messages (SGLang ``GenerateReqInput`` / ``SamplingParams``).

Field names, defaults and shapes follow SGLang so that RL trainers written
against SGLang work unchanged. Types are coerced as SGLang's own request models
coerce them (pydantic's lax mode, :class:`~router.contract.base.WireRequest`).
Unknown fields are ignored (newer SGLang clients send more than we read), but
known SGLang sampling knobs that this worker does not implement are rejected
when set to anything but their neutral value, so a trainer never silently gets
a different distribution than it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from router.contract.base import MAX_ITEMS, Label, Text, WireRequest, WireResponse
from router.contract.lora import LoraName

#: Every omni-worker answer names the process that produced it: a router compares it with the
#: instance its last probe saw, so an answer from a process that restarted since (and came back
#: with its boot checkpoint) is never passed on as if it came from the fleet's weights.
INSTANCE_HEADER = "X-Omni-Instance"

#: Sampling knobs SGLang knows that this worker does not implement, with the
#: value that means "off". Anything else is refused instead of being ignored.
UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
}


#: A sampling seed: what ``torch.Generator.manual_seed`` takes (a signed or unsigned 64-bit integer).
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class SamplingParams(WireRequest):
    """Per-request sampling parameters (SGLang ``SamplingParams`` subset).

    ``temperature == 0`` means greedy decoding (deterministic). ``top_k == -1``
    disables top-k. ``seed`` (alias ``sampling_seed``, SGLang's newer name) makes
    a sampled request reproducible: it seeds a per-request ``torch.Generator``.
    """

    max_new_tokens: int = Field(128, ge=0, le=2**31)
    min_new_tokens: int = Field(0, ge=0, le=2**31)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, le=2**31)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_ITEMS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(le=2**31)]], Field(max_length=MAX_ITEMS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: Seed | None = None
    sampling_seed: Seed | None = None
    # Accepted for compatibility; only their neutral values are allowed.
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        stops = self.stop_strings()
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids must be non-negative")
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError("seed and sampling_seed disagree")
        for name, neutral in UNSUPPORTED_NEUTRAL.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"sampling parameter {name}={getattr(self, name)!r} is not supported by this worker")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def effective_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.sampling_seed


class GenerateRequest(WireRequest):
    """``POST /generate`` body: one prompt or a batch (SGLang ``GenerateReqInput``).

    Exactly one of ``text`` / ``input_ids`` is given. A batch is a list of
    prompts; ``sampling_params``, ``rid`` and ``return_logprob`` may then be one
    value for all prompts or a list with one entry per prompt (``rid`` must be a
    list for a batch, as in SGLang).
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=64)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Label | Annotated[list[Label], Field(max_length=MAX_ITEMS)] | None = None
    lora_path: LoraName | Annotated[list[LoraName | None], Field(max_length=MAX_ITEMS)] | None = None
    """The LoRA adapter each prompt is generated with, by name, as SGLang names it (a list: one per
    prompt of a batch, ``None`` for the base model)."""

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        n = self.batch_size
        if n == 0:
            raise ValueError("a batch must contain at least one prompt")
        for name in ("sampling_params", "return_logprob", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch or len(value) != n):
                raise ValueError(
                    f"{name} is a list of {len(value)} but the request has {n} prompt(s)"
                    if self.is_batch
                    else f"{name} must not be a list for a single prompt"
                )
        if self.rid is not None:
            if self.is_batch and not isinstance(self.rid, list):
                raise ValueError("rid must be a list for a batch request")
            if isinstance(self.rid, list) and (not self.is_batch or len(self.rid) != n):
                raise ValueError("rid must be a string for a single prompt, or a list with one rid per prompt")
            rids = self.rid if isinstance(self.rid, list) else [self.rid]
            if any(r == "" for r in rids):
                raise ValueError("rid must be non-empty")
            if len(set(rids)) != len(rids):
                raise ValueError("rids in one batch must be distinct")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids
        return ids is not None and len(ids) > 0 and isinstance(ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def item_sampling_params(self, i: int) -> SamplingParams:
        sp = self.sampling_params
        if isinstance(sp, list):
            return sp[i]
        return sp if sp is not None else SamplingParams()

    def item_return_logprob(self, i: int) -> bool:
        rl = self.return_logprob
        if isinstance(rl, list):
            return rl[i]
        return bool(rl)

    def item_lora_path(self, i: int) -> str | None:
        lp = self.lora_path
        return lp[i] if isinstance(lp, list) else lp

    def item_rid(self, i: int) -> str | None:
        if self.rid is None:
            return None
        return self.rid[i] if isinstance(self.rid, list) else self.rid


class FinishReason(WireResponse):
    """``{"type": "stop", "matched": ...}`` | ``{"type": "length", "length": N}`` | ``{"type": "abort", "message": ...}``."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class WeightVersionSpan(WireResponse):
    """Output tokens ``[start, end)`` sampled by the weights of ``version`` (SGLang v0.5.23)."""

    version: str
    start: int
    end: int


#: One token's ``[logprob, token id, text]`` (text only with ``return_text_in_logprobs``), as SGLang lists them.
LogprobEntry = tuple[float | None, int, str | None]


class GenerateMetaInfo(WireResponse):
    """``meta_info`` of one prompt's response (SGLang field names); the logprob lists only with
    ``return_logprob`` (``output_top_logprobs`` only with ``top_logprobs_num``)."""

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str
    """The version that sampled the last output token (the served version for an empty output)."""
    weight_versions: list[WeightVersionSpan] | None = None
    """Ordered, adjacent spans covering every output token; one ``{version, 0, 0}`` for an empty output."""
    first_token_weight_version: str | None = None
    """The version that sampled the first output token; null before there is one."""
    total_retractions: int = 0
    lora_name: str | None = None
    """The LoRA adapter that served the request (this project's; left out for the base model)."""
    lora_version: int | None = None
    """That adapter's version: its loads counted, so an updated adapter answers with a higher one."""
    e2e_latency: float | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None


class GenerateResponse(WireResponse):
    """One prompt's result: ``{"text", "output_ids", "meta_info"}`` (a list of these for a batch).
    Streamed, each event is the prompt's result so far, with ``index`` (its place) in a batch."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int | None = None
