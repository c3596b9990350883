"""The tokenizer files llama.cpp's converter classes read, judged from a file list
(``service.shims.llama_cpp_convert.vocab``; that upstream reads them so is
tests/integration/shims/test_llama_cpp_convert.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.shims.llama_cpp_convert.vocab import missing_sentencepiece, unread_embedding


def _files(root: Path, *names: str, tokenizer_class: str | None = None) -> Path:
    root.mkdir()
    for name in names:
        (root / name).write_text("{}")
    if tokenizer_class is not None:
        (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    return root


@pytest.mark.parametrize(
    "arch", ["GemmaForCausalLM", "Gemma2ForCausalLM", "InternLM3ForCausalLM", "Phi3ForCausalLM"]
)
def test_a_sentencepiece_family_without_tokenizer_model_is_named_with_what_it_has(
    arch: str, tmp_path: Path
) -> None:
    root = _files(tmp_path / "ckpt", "tokenizer.json", "tokenizer_config.json")
    reason = missing_sentencepiece(arch, root)
    assert reason is not None
    assert "SentencePiece tokenizer.model only" in reason
    assert "it has tokenizer.json, tokenizer_config.json" in reason
    assert missing_sentencepiece(arch, _files(tmp_path / "spm", "tokenizer.model")) is None


def test_phi3_with_a_gpt2_tokenizer_class_takes_its_byte_level_bpe(tmp_path: Path) -> None:
    """Phi-4's case: upstream's Phi-3 class writes a BPE vocabulary for GPT2Tokenizer."""
    bpe = _files(tmp_path / "bpe", "tokenizer.json", tokenizer_class="GPT2Tokenizer")
    assert missing_sentencepiece("Phi3ForCausalLM", bpe) is None
    other = _files(tmp_path / "other", "tokenizer.json", tokenizer_class="LlamaTokenizer")
    assert missing_sentencepiece("Phi3ForCausalLM", other) is not None


def test_families_whose_class_falls_back_need_no_tokenizer_model(tmp_path: Path) -> None:
    root = _files(tmp_path / "ckpt", "tokenizer.json")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM", "CohereForCausalLM"):
        assert missing_sentencepiece(arch, root) is None


def test_gemma3_needs_a_tokenizer_to_size_its_embedding_even_without_a_vocabulary(
    tmp_path: Path,
) -> None:
    bare = _files(tmp_path / "bare", "config.json")
    reason = unread_embedding("Gemma3ForCausalLM", bare)
    assert reason is not None and "tokenizer.model or tokenizer.json" in reason
    assert unread_embedding("Gemma3ForCausalLM", _files(tmp_path / "json", "tokenizer.json")) is None
    assert unread_embedding("LlamaForCausalLM", bare) is None
