"""The generated reference pages in docs/ match the code they are generated from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_docs_are_current(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("generate_tables", ROOT / "docs" / "generate_tables.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    code = generator.main(["--check"])
    assert code == 0, (
        f"a generated table in docs/ is stale: run python docs/generate_tables.py\n{capsys.readouterr().err}"
    )
