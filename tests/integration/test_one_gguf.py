"""The environment has exactly one ``gguf``: the gguf-py of the pinned llama.cpp.

With two, what ``import gguf`` gives depends on ``sys.path`` order or on which module imported it
first, and llama.cpp's converter classes (which need their own gguf-py, newer than PyPI's of the
same version string) would disagree with the GGUF writer and the offload store's GGML blocks on
enums and constants. ``make install``, the image and CI install it (scripts/install_gguf_py.sh).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import gguf

from service.shims.llama_cpp_convert import converter_dir


def test_one_distribution_provides_gguf() -> None:
    providers = importlib.metadata.packages_distributions().get("gguf", [])
    assert providers == ["gguf"], f"top-level `gguf` is provided by {providers}"
    on_path = [
        entry for entry in sys.path
        if (Path(entry or ".") / "gguf" / "__init__.py").is_file()
        or (Path(entry or ".") / "gguf.py").is_file()
    ]  # fmt: skip
    assert len(on_path) == 1, f"a `gguf` can be imported from each of {on_path}"


def test_the_imported_gguf_is_the_installed_distribution_in_a_fresh_process() -> None:
    """No module swap anywhere: a fresh interpreter's ``gguf`` is the distribution's files."""
    fresh = subprocess.run(
        [sys.executable, "-c", "import gguf; print(gguf.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    installed = importlib.metadata.distribution("gguf").locate_file("gguf/__init__.py")
    assert Path(fresh).resolve() == Path(str(installed)).resolve() == Path(gguf.__file__).resolve()


def test_the_installed_gguf_is_the_pinned_llama_cpps_gguf_py() -> None:
    pinned = converter_dir() / "gguf-py" / "gguf"
    installed = Path(gguf.__file__).parent
    sources = sorted(p.relative_to(pinned) for p in pinned.rglob("*.py"))
    assert sources, f"no gguf-py modules at {pinned}"
    differ = [
        str(rel) for rel in sources
        if not (installed / rel).is_file()
        or (installed / rel).read_bytes() != (pinned / rel).read_bytes()
    ]  # fmt: skip
    assert differ == [], (
        f"{installed} is not llama.cpp's gguf-py ({pinned}): {differ} differ; "
        "run `make install` (scripts/install_gguf_py.sh)"
    )
