"""Tokenizers: ``tokenizer.json`` through the ``tokenizers`` library, else bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the worker needs from a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def id_to_token(self, token: int) -> str: ...


class ByteTokenizer:
    """Token ids 0..255 are raw UTF-8 bytes; ids above are specials that decode to nothing."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, token: int) -> str:
        """A byte's token as Latin-1 text (one character per byte); a special decodes to nothing."""
        return bytes([token]).decode("latin-1") if 0 <= token < 256 else ""


class HfTokenizer:
    """A ``tokenizer.json`` file loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False`` for text that already holds them (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_token(self, token: int) -> str:
        """The token's string in the vocabulary (transformers' ``convert_ids_to_tokens``)."""
        return self._tok.id_to_token(token) or ""


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    path = Path(model_path) / "tokenizer.json"
    return HfTokenizer(path) if path.is_file() else ByteTokenizer()
