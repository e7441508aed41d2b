"""Logits → next token, per request, and the stop conditions.

Logprobs follow SGLang's default: the log-softmax of the temperature-scaled
logits (temperature 0 counts as 1), taken *before* top-k / top-p / min-p
filtering, so a trainer can compare them with its own ``log_softmax(logits / T)``.

Randomness: a request with a ``seed`` samples from its own ``torch.Generator``
(created on the model's device), so its output does not depend on the batch it
shares or on a retraction in between. Unseeded requests share one generator.
Greedy rows take ``argmax`` (the lowest id wins a tie): deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from worker.engine.request import FinishReason, GenerationParams, Request


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    return gen


def _filter_row(scaled: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """Probabilities of one row after top-k, top-p and min-p filtering."""
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the best token always stays.
        drop_sorted = (cumulative - sorted_probs) > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_batch(
    logits: torch.Tensor, requests: Sequence[Request], shared_generator: torch.Generator
) -> list[tuple[int, float | None, list[tuple[float, int]] | None]]:
    """Pick one token per row of ``logits`` ``[B, vocab]`` (float32).

    Returns ``(token, logprob or None, top logprobs or None)`` per request.
    """
    temps = torch.tensor(
        [r.params.temperature if r.params.temperature > 0 else 1.0 for r in requests],
        device=logits.device,
        dtype=logits.dtype,
    )
    scaled = logits / temps[:, None]
    want_logprobs = any(r.params.return_logprob for r in requests)
    logprobs = torch.log_softmax(scaled, dim=-1) if want_logprobs else None
    greedy_ids = torch.argmax(logits, dim=-1)

    tokens: list[int] = greedy_ids.tolist()
    for i, req in enumerate(requests):
        if req.params.greedy:
            continue
        probs = _filter_row(scaled[i], req.params)
        gen = req.generator if req.generator is not None else shared_generator
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())

    results: list[tuple[int, float | None, list[tuple[float, int]] | None]] = []
    for i, req in enumerate(requests):
        lp: float | None = None
        top: list[tuple[float, int]] | None = None
        if req.params.return_logprob and logprobs is not None:
            lp = float(logprobs[i, tokens[i]].item())
            if req.params.top_logprobs_num:
                values, ids = torch.topk(logprobs[i], req.params.top_logprobs_num)
                top = list(zip(values.tolist(), ids.tolist(), strict=True))
        results.append((tokens[i], lp, top))
    return results


def check_finish(
    req: Request, token: int, eos_token_ids: frozenset[int], decode: Callable[[list[int]], str], context_len: int
) -> FinishReason | None:
    """The finish reason after ``token`` was appended to ``req``, or None to go on.

    Order follows SGLang: stop tokens / EOS, then stop strings, then length.
    ``min_new_tokens`` suppresses the stop conditions (not the length limit).
    """
    params = req.params
    produced = len(req.output_ids)
    if produced >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return FinishReason.stopped(token)
        if params.stop_strings:
            text = decode(req.output_ids)
            for stop in params.stop_strings:
                if stop in text:
                    return FinishReason.stopped(stop)
    if produced >= params.max_new_tokens:
        return FinishReason.at_length(params.max_new_tokens)
    if req.total_len >= context_len:
        return FinishReason.at_length(produced)
    return None


def trim_stop_string(text: str, finish_reason: FinishReason | None, no_stop_trim: bool) -> str:
    """Cut the output text before the matched stop string, as SGLang does by default."""
    matched = finish_reason.stop_string if finish_reason is not None else None
    if no_stop_trim or matched is None:
        return text
    index = text.find(matched)
    return text[:index] if index >= 0 else text
