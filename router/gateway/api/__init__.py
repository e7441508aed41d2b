"""Thin aiohttp handlers: parse, call one policy object, serialize. The table is in ``router.gateway.app``."""
