"""STAND-IN for torchvision, on ``sys.path`` only in the verl driver's process (``_verl_driver.py``).

SGLang's and verl's module graphs import ``torchvision.transforms`` (and friends) at import time for
their multimodal processors, which the HTTP adapter and the weight-sync helpers never run. PyPI's
only torchvision build for torch 2.13 links CUDA libraries and cannot load beside torch's CPU build.
This package lets those imports resolve: any attribute of it or its submodules is a placeholder,
and calling, instantiating or subclassing a placeholder raises, so if code under test ever used
torchvision the test would fail rather than run on something fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

#: transformers compares this to decide which image processors it may offer; none of them is run.
__version__ = "0.28.0"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def _refuse(self, *_: Any, **__: Any) -> NoReturn:
        raise RuntimeError(f"{self._name} was used, but torchvision is only a placeholder in the client tier")

    __call__ = _refuse
    __mro_entries__ = _refuse


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str) -> _Placeholder:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{__name__}.{attr}")
