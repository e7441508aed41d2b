"""The routes whose request goes on to one worker through the proxy: one table, whichever server takes them.

Each router path names the worker path it is forwarded to and how its body is made ready
(:mod:`router.gateway.routing.prepare`). aiohttp serves them with :func:`router.gateway.api.proxied.proxied`;
a data plane's own server for the generation routes (:mod:`router.gateway.frontend`) reads the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.contract.vllm_tokens import DETOKENIZE_PATH, TOKENIZE_PATH
from router.contract.vllm_tokens import GENERATE_PATH as TOKENS_GENERATE_PATH
from router.gateway.routing.prepare import Prepare, passthrough, sglang_prepare, tokens_prepare

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Proxied:
    worker_path: str
    prepare: Prepare = sglang_prepare


#: Router path → how it is proxied. ``/generate`` and the OpenAI routes get a ``rid`` (aborted by prefix);
#: vLLM's token generation its ``request_id``; (de)tokenizing is forwarded as it came.
PROXIED: dict[str, Proxied] = {
    "/generate": Proxied("/generate"),
    COMPLETIONS_PATH: Proxied(COMPLETIONS_PATH),
    CHAT_COMPLETIONS_PATH: Proxied(CHAT_COMPLETIONS_PATH),
    TOKENS_GENERATE_PATH: Proxied(TOKENS_GENERATE_PATH, tokens_prepare),
    TOKENIZE_PATH: Proxied(TOKENIZE_PATH, passthrough),
    DETOKENIZE_PATH: Proxied(DETOKENIZE_PATH, passthrough),
}
