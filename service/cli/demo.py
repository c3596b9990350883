"""``modelprep demo-model DIR``: a real, tiny checkpoint to try the service on, made offline.

A two-layer Llama (hidden size 64, vocabulary 128: about 0.2 MB of float32 weights) written by
``transformers`` itself (``save_pretrained``: ``config.json``, ``generation_config.json``,
``model.safetensors``) with seeded random weights, and a word-level tokenizer built with
``tokenizers`` (``tokenizer.json``, ``tokenizer_config.json``...). Nothing is downloaded, and
the same seed writes the same tensors. Its outputs are noise; everything else about it is a
checkpoint as the hub serves one, so every export of the service runs on it (GGUF types that
llama.cpp must run need ``"verify": false``: llama.cpp does not know a word-level vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]
VOCAB_SIZE = 128

CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 5,
    "eos_token_id": 6,
    "pad_token_id": 0,
}
"""The Llama configuration of the demo model (grouped-query attention, like real Llamas)."""


def write_demo_model(out_dir: Path, seed: int = 0) -> list[Path]:
    """Write the demo checkpoint into ``out_dir`` (created); the files written, sorted."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(str(out_dir))

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", bos_token="<s>", eos_token="</s>",
    ).save_pretrained(str(out_dir))
    return sorted(p for p in out_dir.iterdir() if p.is_file())
