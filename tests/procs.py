"""Process helpers for tests (see :mod:`router.launch`)."""

from router.launch import ManagedProcess, cli, free_port, http_json, start_worker  # noqa: F401
