"""omni-worker: a model server with the SGLang-compatible RL admin surface.

From :mod:`router` the worker imports only the shared wire contract (:mod:`router.contract`),
its torch half (:mod:`router.dataplane`) and ``router.__version__``; never the gateway or the
trainer client, and nothing imports the worker. It needs the ``worker`` extra (torch,
safetensors, tokenizers, jinja2); the ``omni-worker`` script (:mod:`worker.launcher`) says so
and exits when it is missing. This package root and the launcher import no torch.
"""
