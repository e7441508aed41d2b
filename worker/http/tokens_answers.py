"""The bodies of vLLM's token answers (``/inference/v1/generate``): whole and streamed.

A ``tokens`` :class:`~worker.http.openai_calls.Call` answers vLLM's ``GenerateResponse``
(:class:`~router.contract.vllm_tokens.TokensGenerateResponse`: ``request_id``, ``choices[].token_ids``,
logprobs as ``token_id:<id>`` entries, every field sent, ``null`` when absent, as vLLM's
``model_dump`` sends them) and streams its ``GenerateStreamResponse`` events
(:class:`~router.contract.vllm_tokens.TokensStreamResponse`). Each choice carries its weight
versions, and the answer the version that sampled its newest token, as on the OpenAI routes.
"""

from __future__ import annotations

from router.contract.openai import TokenLogprob, TopLogprob, Usage
from router.contract.vllm_tokens import TokensChoice, TokensGenerateResponse, TokensLogprobs, TokensStreamResponse
from worker.engine.model_worker import ModelWorker
from worker.http.openai_calls import Call, Choice, finish, logprob, spans, usage, weight_version


def _logprobs(call: Call, choice: Choice, start: int, end: int) -> TokensLogprobs | None:
    """Each token as ``token_id:<id>``, and ``max(k, 1)`` top entries with the sampled token first
    (vLLM's per-position dict holds the sampled token, then the top k)."""
    if call.logprobs is None:
        return None
    h = choice.running
    keep = max(call.logprobs, 1)

    def entry(token: int, value: float) -> TopLogprob:
        return TopLogprob(token=f"token_id:{token}", logprob=logprob(value), bytes=None)

    content = []
    for i in range(start, min(end, len(h.logprobs))):
        token, value = h.output_ids[i], h.logprobs[i]
        rows = h.top_logprobs[i] if i < len(h.top_logprobs) else []
        sampled = entry(token, value)
        tops = [sampled, *(entry(t, lp) for lp, t in rows if t != token)]
        content.append(
            TokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes, top_logprobs=tops[:keep])
        )
    return TokensLogprobs(content=content)


def _choice(call: Call, worker: ModelWorker, choice: Choice, start: int, end: int, whole: bool) -> TokensChoice:
    """The choice's tokens ``[start, end)``; a whole answer's ``finish_reason`` is never null (vLLM's default)."""
    h = choice.running
    reason, _ = finish(choice)
    return TokensChoice(
        index=choice.index,
        logprobs=_logprobs(call, choice, start, end),
        finish_reason=(reason or "stop") if whole else reason,
        token_ids=h.output_ids[start:end],
        routed_experts=None,
        sampling_mask=None,
        weight_versions=spans(worker, choice),
        first_token_weight_version=h.first_token_weight_version,
    )


def response_body(call: Call, worker: ModelWorker) -> TokensGenerateResponse:
    counts = usage(call)
    counts.prompt_tokens_details = None  # vLLM sends it null
    return TokensGenerateResponse(
        request_id=call.id,
        model=call.model,
        created=call.created,
        weight_version=weight_version(call, worker),
        choices=[_choice(call, worker, c, 0, len(c.running.output_ids), whole=True) for c in call.choices],
        usage=counts,
        prompt_logprobs=None,
        prompt_token_id_logprobs=None,
        prompt_token_ids=call.prompts[0] if call.return_token_ids else None,
        mm_placeholders=None,
        metrics=None,
        kv_transfer_params=None,
        ec_transfer_params=None,
    )


def delta(call: Call, worker: ModelWorker, choice: Choice) -> TokensStreamResponse | None:
    """The event for the tokens ``choice`` produced since its last one (the finish on its last), or None."""
    h = choice.running
    start, end = choice.sent_tokens, len(h.output_ids)
    reason, _ = finish(choice)
    if end == start and reason is None:
        return None
    choice.sent_tokens = end
    choice.closed = reason is not None
    item = _choice(call, worker, choice, start, end, whole=False)
    event = TokensStreamResponse(request_id=call.id, weight_version=weight_version(call, worker), choices=[item])
    # ``usage`` on every event: null, or with continuous_usage_stats this choice's counts so far.
    event.usage = None
    if call.continuous_usage:
        prompt = len(call.prompts[0])
        event.usage = Usage(prompt_tokens=prompt, completion_tokens=end, total_tokens=prompt + end)
    if call.return_token_ids and not call.prompt_ids_sent:
        event.prompt_token_ids = call.prompts[0]
        call.prompt_ids_sent = True
    return event


def usage_chunk(call: Call, worker: ModelWorker) -> TokensStreamResponse:
    """The last event with ``include_usage``: no choices, the call's token counts."""
    return TokensStreamResponse(
        request_id=call.id, weight_version=weight_version(call, worker), choices=[], usage=usage(call)
    )
