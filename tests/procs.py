"""Process helpers for tests (see :mod:`demo.launch`)."""

from demo.launch import ManagedProcess, cli, free_port, http_json, start_worker  # noqa: F401
