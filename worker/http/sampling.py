"""One builder of an engine request's :class:`GenerationParams` from the wire's sampling fields.

Two dialects reach it: SGLang's ``sampling_params`` (``/generate``) and the OpenAI / vLLM fields
(the OpenAI routes and vLLM's ``/inference/v1/generate``, read through :class:`Sampling`). They
name a few things differently (``min_new_tokens`` / ``min_tokens``, ``no_stop_trim`` /
``include_stop_str_in_output``); the conversions every route shares (stop strings and ids, the
seed, the logprobs asked for) are made here once.
"""

from __future__ import annotations

from typing import Protocol

from router.contract.generate import SamplingParams
from worker.engine.request import GenerationParams


class Sampling(Protocol):
    """What a call's choices sample with: the OpenAI requests, and vLLM's ``SamplingParams``."""

    @property
    def max_new_tokens(self) -> int | None: ...
    @property
    def choices_per_prompt(self) -> int: ...
    @property
    def effective_temperature(self) -> float: ...
    @property
    def effective_top_p(self) -> float: ...
    @property
    def effective_top_k(self) -> int: ...
    @property
    def effective_min_p(self) -> float: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> list[int] | None: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...
    @property
    def seed(self) -> int | None: ...
    def stop_strings(self) -> list[str]: ...


def generation_params(
    sampling: SamplingParams | Sampling, *, max_new_tokens: int, seed: int | None, logprobs: int | None
) -> GenerationParams:
    """``max_new_tokens`` and ``seed`` as the route resolved them (from the context left; per choice);
    ``logprobs``: how many top logprobs per token, ``None`` for no logprobs at all."""
    if isinstance(sampling, SamplingParams):
        min_new, no_stop_trim = sampling.min_new_tokens, sampling.no_stop_trim
        temperature, top_p, top_k, min_p = sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p
    else:
        min_new, no_stop_trim = sampling.min_tokens, sampling.include_stop_str_in_output
        temperature, top_p = sampling.effective_temperature, sampling.effective_top_p
        top_k, min_p = sampling.effective_top_k, sampling.effective_min_p
    return GenerationParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min(min_new, max_new_tokens),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop_strings=tuple(sampling.stop_strings()),
        stop_token_ids=frozenset(sampling.stop_token_ids or ()),
        ignore_eos=sampling.ignore_eos,
        no_stop_trim=no_stop_trim,
        seed=seed,
        return_logprob=logprobs is not None,
        top_logprobs_num=logprobs or 0,
    )
