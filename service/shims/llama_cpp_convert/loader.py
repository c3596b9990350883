"""Finding llama.cpp's converter beside the pinned tools, reading what it supports without
importing it, and importing it on the gguf-py of the same llama.cpp (see the package doc)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from service.errors import ToolMissing
from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION, default_bin_dir

CHECKED_VERSIONS = ("0.3.36",)
"""llama-cpp-python sdists whose vendored converter this shim was checked against."""


def converter_dir(bin_dir: Path | None = None) -> Path:
    """``<cache>/llama.cpp/<version>/convert`` beside the tools (scripts/build_llama_cpp.sh)."""
    if LLAMA_CPP_PYTHON_VERSION not in CHECKED_VERSIONS:
        raise ToolMissing(
            f"llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s converter is not one this shim was checked "
            f"on ({', '.join(CHECKED_VERSIONS)}): check service/shims/llama_cpp_convert/"
        )
    path = (bin_dir or default_bin_dir()).parent / "convert"
    if not (path / "conversion" / "__init__.py").is_file():
        raise ToolMissing(
            f"llama.cpp's converter classes not found at {path}; run `make llama-cpp` "
            "(scripts/build_llama_cpp.sh keeps them beside the tools)"
        )
    return path


@lru_cache(maxsize=8)
def _text_model_map(init_file: Path, literal: str = "TEXT_MODEL_MAP") -> dict[str, str]:
    tree = ast.parse(init_file.read_text(encoding="utf-8"))
    for node in tree.body:
        target: ast.expr | None = None
        value_node: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value_node = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value_node = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == literal and value_node:
            value = ast.literal_eval(value_node)
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in value.items()}
    raise ToolMissing(f"{init_file} has no {literal} literal: not the converter checked here")


def supported_architectures(bin_dir: Path | None = None) -> dict[str, str]:
    """Hugging Face architecture name -> upstream module, read without importing the converter."""
    return _text_model_map(converter_dir(bin_dir) / "conversion" / "__init__.py")


def supported_mmproj_architectures(bin_dir: Path | None = None) -> dict[str, str]:
    """Architecture name -> upstream module of the multimodal projectors upstream writes
    (``MMPROJ_MODEL_MAP``, what ``convert_hf_to_gguf.py --mmproj`` dispatches on)."""
    return _text_model_map(converter_dir(bin_dir) / "conversion" / "__init__.py", "MMPROJ_MODEL_MAP")


def mmproj_architecture(config: dict[str, Any]) -> str | None:
    """The architecture ``--mmproj`` dispatches on (``vision_config.architectures`` first, as
    upstream's ``get_model_architecture``), or None for a config without a vision tower."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    names = vision.get("architectures") or config.get("architectures") or []
    return str(names[0]) if names else None


def _import_package(name: str, directory: Path) -> ModuleType:
    """Import the package ``directory`` as ``name`` without putting its parent on ``sys.path``.

    Why not ``sys.path``: the converter's directory also holds ``gguf-py``, whose own directory
    holds ``tests`` and ``examples`` packages, and ``sys.path`` is inherited by every process
    this one starts (multiprocessing children rebuild it from the parent's)."""
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    if spec is None or spec.loader is None:
        raise ToolMissing(f"llama.cpp's converter has no package {name!r} in {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@contextmanager
def temporary_environ(**values: str) -> Iterator[None]:
    """``values`` set in ``os.environ`` for the duration, the previous values restored."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gguf_py_mismatch(bin_dir: Path | None = None) -> str | None:
    """Why the importable ``gguf`` is not the pinned llama.cpp's gguf-py, or None when it is
    (every module of llama.cpp's ``gguf-py/gguf`` installed, byte for byte)."""
    import gguf

    pinned = converter_dir(bin_dir) / "gguf-py" / "gguf"
    installed = Path(str(gguf.__file__)).parent
    for source in sorted(pinned.rglob("*.py")):
        rel = source.relative_to(pinned)
        target = installed / rel
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            return f"{installed / rel} is not {source}"
    return None


def load_converter(bin_dir: Path | None = None) -> ModuleType:
    """Import upstream's ``conversion`` package; :class:`ToolMissing` unless the ``gguf`` it
    imports is the gguf-py of the same llama.cpp."""
    root = converter_dir(bin_dir).resolve()
    mismatch = gguf_py_mismatch(bin_dir)
    if mismatch is not None:
        raise ToolMissing(
            f"the installed gguf package is not llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s gguf-py "
            f"({mismatch}); install it with `make install` (scripts/install_gguf_py.sh)"
        )
    loaded = sys.modules.get("conversion")
    if loaded is None:
        # conversion/base.py puts its gguf-py on sys.path at import (a second gguf, and gguf-py's
        # ``tests`` package, for this process and its children) unless NO_LOCAL_GGUF is set.
        with temporary_environ(NO_LOCAL_GGUF="1"):
            loaded = _import_package("conversion", root / "conversion")
            importlib.import_module("conversion.base")
    if not Path(str(loaded.__file__)).resolve().is_relative_to(root):
        raise ToolMissing(f"another 'conversion' package is imported: {loaded.__file__}")
    # upstream logs every tensor at INFO; keep the job log to what the service says
    logging.getLogger("hf-to-gguf").setLevel(logging.WARNING)
    return loaded
