"""``sync_weights``' keywords (``SyncOptions``) are ``WeightSync``'s, name for name and type for type.

Both clients hand the keywords to :class:`~router.trainer.driver.WeightSync` unchanged, so a keyword
added to one and not the other would be refused by a type checker (or by ``WeightSync``) only when
a trainer first passes it.
"""

from __future__ import annotations

import inspect
import typing

from router.trainer import AsyncRouterClient, RouterClient, SyncOptions, WeightSync


def _weight_sync_keywords() -> dict[str, inspect.Parameter]:
    params = inspect.signature(WeightSync.__init__).parameters
    return {name: p for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_sync_options_are_weight_sync_keywords() -> None:
    keywords = _weight_sync_keywords()
    assert set(SyncOptions.__annotations__) == set(keywords)
    assert SyncOptions.__required_keys__ == {n for n, p in keywords.items() if p.default is inspect.Parameter.empty}
    options = typing.get_type_hints(SyncOptions)
    hints = typing.get_type_hints(WeightSync.__init__)
    assert {n: options[n] for n in keywords} == {n: hints[n] for n in keywords}


def test_both_clients_take_sync_options() -> None:
    for client in (RouterClient, AsyncRouterClient):
        hints = typing.get_type_hints(client.sync_weights)
        assert hints["options"] == typing.Unpack[SyncOptions], client
