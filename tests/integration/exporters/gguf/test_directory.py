"""The vocabulary-skipping header scan (``service.exporters.gguf.directory``) against gguf-py's
GGUFReader, on our file and on one llama.cpp made.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import LlamaForCausalLM

from service.exporters.gguf.directory import read_directory
from tests.fixtures.gguf_files import export_gguf


@pytest.mark.parametrize("which", ["ours", "llama.cpp"])
def test_directory_reader_agrees_with_gguf_reader(
    llama: tuple[Path, LlamaForCausalLM],
    reference: tuple[Path, gguf.GGUFReader],
    tmp_path: Path,
    which: str,
) -> None:
    """The vocabulary-skipping header scan used by verification sees what GGUFReader sees."""
    if which == "ours":
        export_gguf(llama[0], tmp_path / "out", "q4_0")
        path = tmp_path / "out" / "model-q4_0.gguf"
        reader = gguf.GGUFReader(path)
    else:
        path, reader = reference
    directory = read_directory(path)
    assert directory.data_offset == reader.data_offset
    assert [(t.name, t.ggml_type, t.shape, t.offset) for t in directory.tensors] == [
        (t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), t.data_offset)
        for t in reader.tensors
    ]
    for key, kv in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = directory.metadata[key]
        if kv.types[0] == gguf.GGUFValueType.ARRAY:
            assert value == ("array", int(kv.types[-1]), len(kv.data)), key
        elif kv.types[0] == gguf.GGUFValueType.FLOAT32:
            assert value == pytest.approx(kv.contents()), key
        else:
            assert value == kv.contents(), key
    assert len(directory.metadata) == len(reader.fields) - 3
