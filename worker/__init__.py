"""omni-worker: a model server with the SGLang-compatible RL admin surface.

This package root stays free of torch imports so that tooling (and the router's
shared protocol package) can import metadata without pulling torch in.
"""
