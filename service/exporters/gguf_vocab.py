"""The checkpoint's tokenizer as GGUF ``tokenizer.ggml.*`` metadata, the way llama.cpp writes it.

Encodings are tried in llama.cpp's order for the architecture (``LlamaModel.set_vocab``):
a SentencePiece ``tokenizer.model`` (``llama``), a Llama-2 style ``tokenizer.json`` with byte
fallback (``llama``, via ``gguf.LlamaHfVocab``), then a byte-level BPE ``tokenizer.json``
(``gpt2``: tokens, token types, merges, ``tokenizer.ggml.pre``). A tokenizer none of these can
express (word-level, unigram...) or a checkpoint without one is written as ``none``: llama.cpp
loads the weights, and the summary says why there is no vocabulary rather than inventing one.
"""

from __future__ import annotations

import json
import logging
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import ExportFailed

if TYPE_CHECKING:
    from gguf import GGUFWriter

log = logging.getLogger(__name__)

# The pre-tokenizer probe of convert_hf_to_gguf.py's get_vocab_base_pre and a few of its known
# answers (hash of the token ids of this text -> llama.cpp pre-tokenizer name).
_CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
}


class _NotThisEncoding(Exception):
    """The tokenizer files do not hold this encoding; try the next one."""


def add_vocab(
    writer: GGUFWriter, root: Path, vocab_order: tuple[str, ...], vocab_size: int
) -> dict[str, Any]:
    """Write the tokenizer found in ``root``; returns what was written, for the export summary."""
    attempts = {"spm": _add_sentencepiece, "llama_hf": _add_llama_hf, "gpt2": _add_gpt2}
    reasons: list[str] = []
    for encoding in vocab_order:
        try:
            return attempts[encoding](writer, root, vocab_size)
        except _NotThisEncoding as exc:
            reasons.append(f"{encoding}: {exc}")
    writer.add_tokenizer_model("none")
    return {"model": "none", "reason": "; ".join(reasons)}


def _add_sentencepiece(writer: GGUFWriter, root: Path, vocab_size: int) -> dict[str, Any]:
    """``_create_vocab_sentencepiece``: pieces, scores and types from ``tokenizer.model``."""
    import gguf

    path = root / "tokenizer.model"
    if not path.is_file():
        raise _NotThisEncoding("no tokenizer.model")
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    if not sp.LoadFromFile(str(path)):
        raise ExportFailed("tokenizer.model is not a SentencePiece model")
    T = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(T.UNUSED)] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        tokens[i] = sp.IdToPiece(i).encode()
        scores[i] = sp.GetScore(i)
        kind = T.NORMAL
        if sp.IsUnknown(i):
            kind = T.UNKNOWN
        elif sp.IsControl(i):
            kind = T.CONTROL
        elif sp.IsUnused(i):
            kind = T.UNUSED
        elif sp.IsByte(i):
            kind = T.BYTE
        types[i] = int(kind)
    for token_id, token, is_special in _added_tokens(root):
        if token_id < vocab_size:
            tokens[token_id] = token.encode()
            scores[token_id] = -1000.0
            types[token_id] = int(T.CONTROL if is_special else T.USER_DEFINED)
    return _write_llama_vocab(writer, root, tokens, scores, types, "tokenizer.model")


def _added_tokens(root: Path) -> list[tuple[int, str, bool]]:
    config = root / "tokenizer_config.json"
    if not config.is_file():
        return []
    decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    return [(int(i), d["content"], bool(d.get("special"))) for i, d in decoder.items()]


def _add_llama_hf(writer: GGUFWriter, root: Path, vocab_size: int) -> dict[str, Any]:
    """``_set_vocab_llama_hf``: a Llama-2 style (byte-fallback BPE) ``tokenizer.json``."""
    import gguf

    if not (root / "tokenizer.json").is_file():
        raise _NotThisEncoding("no tokenizer.json")
    try:
        vocab = gguf.LlamaHfVocab(root)
    except (FileNotFoundError, TypeError) as exc:
        raise _NotThisEncoding(str(exc)) from None
    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
    return _write_llama_vocab(writer, root, tokens, scores, types, "tokenizer.json")


def _write_llama_vocab(
    writer: GGUFWriter,
    root: Path,
    tokens: list[bytes],
    scores: list[float],
    types: list[int],
    source: str,
) -> dict[str, Any]:
    """The keys of a SentencePiece-style ("llama") vocabulary, whichever file it came from."""
    import gguf

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(root, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    return {
        "model": "llama",
        "source": source,
        "tokens": len(tokens),
        "special": dict(special.special_token_ids),
    }


def _add_gpt2(writer: GGUFWriter, root: Path, vocab_size: int) -> dict[str, Any]:
    """``_set_vocab_gpt2`` / ``get_vocab_base``: byte-level BPE tokens, types and merges."""
    import gguf

    path = root / "tokenizer.json"
    if not path.is_file():
        raise _NotThisEncoding("no tokenizer.json")
    model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    if model.get("type") != "BPE":
        raise _NotThisEncoding(f"tokenizer.json model is {model.get('type')!r}, not BPE")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:  # e.g. a class needing remote code
        raise _NotThisEncoding(f"transformers cannot load it: {exc}") from None
    vocab: dict[str, int] = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise ExportFailed(
            f"tokenizer has id {max(vocab.values())} beyond the model's vocab_size {vocab_size}"
        )
    reverse = {i: tok for tok, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    T = gguf.TokenType
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(T.UNUSED))
            continue
        token = reverse[i]
        if token in added:
            entry = decoder[i]
            if not entry.normalized:
                token = str(tokenizer.decode(tokenizer.encode(token, add_special_tokens=False)))
            if entry.special or _looks_special(token):
                types.append(int(T.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(T.USER_DEFINED))
        else:
            types.append(int(T.NORMAL))
        tokens.append(token)
    digest = sha256(str(tokenizer.encode(_CHKTXT)).encode()).hexdigest()
    pre = KNOWN_PRE_TOKENIZERS.get(digest)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(root, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ExportFailed("byte-level BPE tokenizer.json has no merges")
    special.add_to_gguf(writer, quiet=True)
    summary: dict[str, Any] = {
        "model": "gpt2",
        "source": "tokenizer.json",
        "tokens": len(tokens),
        "merges": len(special.merges),
        "pre": pre or "default",
        "special": dict(special.special_token_ids),
    }
    if pre is None:
        summary["pre_warning"] = f"pre-tokenizer {digest[:12]} unknown to this exporter"
    return summary


def _looks_special(token: str) -> bool:
    """``does_token_look_special``: added tokens that are control tokens in all but name."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )
