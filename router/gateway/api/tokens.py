"""vLLM's token routes through the router: ``/inference/v1/generate``, ``/tokenize``, ``/detokenize``.

Each goes to one routable worker through the same :class:`~router.gateway.routing.proxy.GenerateProxy`
as ``/generate``: the policy picks among workers that hold the fleet's weights, a failure before
the first byte is retried on another worker, streams pass through, and bodies are the worker's
(a caller's mistake is its 400). A token generation whose caller goes away is aborted on its
worker by its id (``/abort_requests``); it gets a ``request_id`` when it has none, so its answer's
``request_id`` names it there. (De)tokenizing needs no weights, but it is routed like generation:
with no routable worker it is a 503.
"""

from __future__ import annotations

from router.contract.vllm_tokens import (
    DETOKENIZE_PATH,
    GENERATE_PATH,
    TOKENIZE_PATH,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokensGenerateRequest,
    TokensGenerateResponse,
)
from router.contract.web.openapi import Route
from router.gateway.api.proxied import proxied


def routes() -> list[Route]:
    return [
        Route(
            "POST",
            GENERATE_PATH,
            proxied,
            "Generate from token ids on one routable worker (vLLM's token-in/token-out route; streams when asked)",
            access="generation",
            body=TokensGenerateRequest,
            answer=TokensGenerateResponse,
        ),
        Route(
            "POST",
            TOKENIZE_PATH,
            proxied,
            "Tokenize a prompt or chat messages on one routable worker (vLLM)",
            access="generation",
            body=TokenizeRequest,
            answer=TokenizeResponse,
        ),
        Route(
            "POST",
            DETOKENIZE_PATH,
            proxied,
            "The text of token ids, from one routable worker (vLLM)",
            access="generation",
            body=DetokenizeRequest,
            answer=DetokenizeResponse,
        ),
    ]
