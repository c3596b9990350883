"""The tokenizer files upstream's converter class for an architecture reads, judged from the file
list alone (no import of the converter), so a checkpoint it would fail on is refused at
submission instead of failing in the job.

Read from the pinned converter's source (``conversion/*.py``; ``tests/integration/shims/
test_llama_cpp_convert.py`` runs each class on a checkpoint without the file and checks that it
fails as described here):

* ``GemmaModel.set_vocab`` and ``Gemma2Model.set_vocab`` call ``_set_vocab_sentencepiece``,
  whose ``_create_vocab_sentencepiece`` raises ``FileNotFoundError`` without ``tokenizer.model``;
  ``InternLM3Model.set_vocab`` calls ``_create_vocab_sentencepiece`` itself;
* ``Phi3MiniModel.set_vocab`` writes a byte-level BPE when ``tokenizer_config.json`` names
  ``GPT2Tokenizer`` (Phi-4), else raises ``ValueError('Error: Missing .../tokenizer.model')``;
* ``Gemma3Model.modify_tensors`` cuts the embedding to the tokenizer's vocabulary, read from
  ``tokenizer.model``, else ``tokenizer.json`` (``open`` raises without either), whether or not a
  vocabulary is written.

Other classes fall back from one vocabulary writer to the next (``LlamaModel``, ``Qwen2Model``,
``Gemma3Model.set_vocab``) or write a byte-level BPE from whatever the tokenizer files are.
"""

from __future__ import annotations

import json
from pathlib import Path

SENTENCEPIECE_ONLY: dict[str, str] = {
    "GemmaForCausalLM": "GemmaModel",
    "Gemma2ForCausalLM": "Gemma2Model",
    "InternLM3ForCausalLM": "InternLM3Model",
    "Phi3ForCausalLM": "Phi3MiniModel",
}
"""Architecture -> upstream class whose vocabulary is written from ``tokenizer.model`` only."""

BPE_TOKENIZER_CLASS: dict[str, str] = {"Phi3ForCausalLM": "GPT2Tokenizer"}
"""Architecture -> the ``tokenizer_class`` with which its class writes a BPE vocabulary instead."""

EMBEDDING_CUT_TO_TOKENIZER: dict[str, str] = {
    "Gemma3ForCausalLM": "Gemma3Model",
    "Gemma3ForConditionalGeneration": "Gemma3Model",
}
"""Architecture -> upstream class that reads the tokenizer's size to write the embedding."""


def _tokenizer_class(root: Path) -> str | None:
    try:
        data = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("tokenizer_class") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def unread_embedding(architecture: str, root: Path) -> str | None:
    """Why upstream's class cannot write ``architecture``'s token embedding from ``root`` (it
    reads the tokenizer's size and the checkpoint has no file to read it from), or None."""
    upstream = EMBEDDING_CUT_TO_TOKENIZER.get(architecture)
    if upstream is None or any((root / n).is_file() for n in ("tokenizer.model", "tokenizer.json")):
        return None
    return (
        f"llama.cpp's converter ({upstream}) cuts the token embedding to the tokenizer's "
        "vocabulary, read from tokenizer.model or tokenizer.json, and the checkpoint has neither"
    )


def missing_sentencepiece(architecture: str, root: Path) -> str | None:
    """Why upstream's class cannot write ``architecture``'s vocabulary from the tokenizer files
    in ``root`` (naming the file it reads), or None. Only asked when the checkpoint has
    tokenizer files: without any, the file gets no vocabulary and ``set_vocab`` is not called."""
    upstream = SENTENCEPIECE_ONLY.get(architecture)
    if upstream is None or (root / "tokenizer.model").is_file():
        return None
    escape = BPE_TOKENIZER_CLASS.get(architecture)
    if escape is not None and _tokenizer_class(root) == escape:
        return None
    present = sorted(
        p.name for p in root.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges"))
    )
    also = (
        f" (or a byte-level BPE when tokenizer_config.json's tokenizer_class is {escape})"
        if escape
        else ""
    )
    return (
        f"llama.cpp's converter ({upstream}) writes {architecture}'s vocabulary from a "
        f"SentencePiece tokenizer.model only{also}, and the checkpoint has none (it has "
        f"{', '.join(present) or 'no tokenizer files'})"
    )
