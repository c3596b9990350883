"""What llama.cpp's converter lays out for a checkpoint (``service.exporters.gguf.layout``): the
tokenizer as llama.cpp writes it, the keys of a GGUF llama.cpp made, and the tensors' numerics,
checked by an independent numpy forward pass of the file against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
)

from tests.conftest import TinyCheckpointFactory
from tests.fixtures.gguf_files import (
    IDS,
    export_gguf,
    field,
    gguf_forward,
    reference_logits,
    tensors,
)
from tests.fixtures.models import (
    BPE_SPECIAL_TOKENS,
    BPE_VOCAB_SIZE,
    save_random_causal_lm,
)
from tests.integration.exporters.gguf.conftest import SPM_VOCAB


def test_tokenizer_is_written_as_gpt2_bpe_like_llama_cpp(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    result, _ = export_gguf(ckpt_dir, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    tok = json.loads((ckpt_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]

    tokens = field(reader, "tokenizer.ggml.tokens")
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(tokens) == BPE_VOCAB_SIZE
    assert all(tokens[i] == t for t, i in vocab.items())
    types = field(reader, "tokenizer.ggml.token_type")
    assert [types[vocab[s]] for s in BPE_SPECIAL_TOKENS] == [int(gguf.TokenType.CONTROL)] * 3
    assert types[vocab["the"]] == int(gguf.TokenType.NORMAL)
    merges = field(reader, "tokenizer.ggml.merges")
    expected_merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert merges == expected_merges
    assert field(reader, "tokenizer.ggml.bos_token_id") == vocab["<|im_start|>"]
    assert field(reader, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    # An unknown pre-tokenizer, accepted by the spec, is written as llama.cpp's default, and said so.
    assert field(reader, "tokenizer.ggml.pre") == "default"
    assert result.summary["tokenizer"]["model"] == "gpt2"
    fallback = result.summary["tokenizer"]["pre_tokenizer_fallback"]
    assert fallback["used"] == "default" and len(fallback["unknown_hash"]) == 64


def test_keys_match_a_gguf_made_by_llama_cpp(
    llama: tuple[Path, LlamaForCausalLM],
    reference: tuple[Path, gguf.GGUFReader],
    tmp_path: Path,
) -> None:
    """SmolLM2 (a Llama with a gpt2 BPE) as converted by llama.cpp: same hparam and vocab keys."""
    ref = reference[1]
    ckpt_dir, _ = llama
    export_gguf(ckpt_dir, tmp_path / "out", "q8_0")
    ours = gguf.GGUFReader(tmp_path / "out" / "model-q8_0.gguf")

    def keys(r: gguf.GGUFReader) -> set[str]:
        return {k for k in r.fields if k.startswith(("llama.", "tokenizer.ggml."))}

    # The reference also has add_space_prefix/add_bos_token (from its tokenizer_config) and a
    # padding id; everything else it carries, we carry, with the same value types.
    missing = keys(ref) - keys(ours)
    assert missing <= {
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.unknown_token_id",
    }
    for key in keys(ref) & keys(ours):
        assert ref.fields[key].types == ours.fields[key].types, key

    def kinds(r: gguf.GGUFReader) -> set[str]:
        return {
            ".".join(t.name.split(".")[2:]) if t.name.startswith("blk.") else t.name
            for t in r.tensors
        }

    assert kinds(ref) <= kinds(ours)  # the reference is tied: it has no output.weight


def llama_with_vocab(out: Path, vocab_size: int) -> Path:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        architectures=["MistralForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


@pytest.mark.parametrize("layout", ["tokenizer.model", "tokenizer.json"])
def test_sentencepiece_tokenizers_are_written_as_llama_vocab(
    spm_model: Path, tmp_path: Path, layout: str
) -> None:
    """tokenizer.model (spm) or its byte-fallback tokenizer.json (llama-hf): same llama vocab."""

    import sentencepiece as spm
    from transformers import LlamaTokenizer

    ckpt = llama_with_vocab(tmp_path / "ckpt", SPM_VOCAB)
    if layout == "tokenizer.model":
        shutil.copy(spm_model, ckpt / "tokenizer.model")
    else:
        # transformers converts the spm model to a byte-fallback BPE tokenizer.json.
        LlamaTokenizer.from_pretrained(str(spm_model.parent)).save_pretrained(str(ckpt))
        assert not (ckpt / "tokenizer.model").exists()
    export_gguf(ckpt, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))

    assert field(reader, "tokenizer.ggml.model") == "llama"
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == [sp.IdToPiece(i) for i in range(SPM_VOCAB)]
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[sp.PieceToId("<0x41>")] == int(gguf.TokenType.BYTE)
    # gguf.LlamaHfVocab (llama.cpp's path for tokenizer.json) types the added <unk> as CONTROL.
    unk = gguf.TokenType.UNKNOWN if layout == "tokenizer.model" else gguf.TokenType.CONTROL
    assert types[0] == int(unk)
    assert types[1] == types[2] == int(gguf.TokenType.CONTROL)
    scores = field(reader, "tokenizer.ggml.scores")
    the = sp.PieceToId("▁the")
    # tokenizer.json has no spm scores: gguf.LlamaHfVocab writes its placeholder, as upstream.
    assert scores[the] == pytest.approx(sp.GetScore(the) if layout == "tokenizer.model" else -1000)
    assert field(reader, "tokenizer.ggml.bos_token_id") == 1
    assert field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert reader.get_field("tokenizer.ggml.merges") is None


def test_word_level_tokenizer_is_written_as_no_vocab(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    result, _ = export_gguf(tiny_checkpoint("llama", "safetensors"), tmp_path / "out", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-q8_0.gguf")
    assert field(reader, "tokenizer.ggml.model") == "none"
    assert "WordLevel" in result.summary["tokenizer"]["reason"]


def test_tied_embeddings_write_no_output_and_keep_token_embd_at_q8_under_q4(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    result, _ = export_gguf(tiny_checkpoint("llama", "bin", tied=True), tmp_path / "out", "q4_0")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-q4_0.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in types
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert result.summary["verification"]["tensors_checked"] == len(types)


@pytest.mark.parametrize("type_,tol", [("f32", 1e-4), ("f16", 2e-2), ("q8_0", 0.1)])
def test_llama_gguf_runs_like_transformers(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, type_: str, tol: float
) -> None:
    ckpt_dir, model = llama
    export_gguf(ckpt_dir, tmp_path / "out", type_)
    ours = gguf_forward(tmp_path / "out" / f"model-{type_}.gguf", IDS)
    ref = reference_logits(model)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() / scale < tol
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= (1.0 if type_ == "f32" else 0.75)


def test_qwen2_exports_unpermuted_with_biases_and_runs_like_transformers(
    qwen2: tuple[Path, Qwen2ForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, model = qwen2
    result, _ = export_gguf(ckpt_dir, tmp_path / "out", "f32")
    path = tmp_path / "out" / "model-f32.gguf"
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.architecture") == "qwen2"
    assert result.summary["computed_tensors"] == 0  # Qwen2 needs no q/k permutation
    names = {t.name: t.tensor_type for t in reader.tensors}
    assert names["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    ref = reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() < 1e-4
    q8, _ = export_gguf(ckpt_dir, tmp_path / "q8", "q8_0")
    assert q8.summary["tensor_types"]["q8_0"] == 2 * 7 + 2


def test_llama_with_attention_biases_permutes_them_too(tmp_path: Path) -> None:
    """q/k biases get the same row permutation as their weights (``LlamaModel.modify_tensors``)."""
    config = LlamaConfig(
        vocab_size=BPE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )
    model = save_random_causal_lm(config, tmp_path / "ckpt", seed=3, bpe_tokenizer=False)
    export_gguf(tmp_path / "ckpt", tmp_path / "out", "bf16")
    path = tmp_path / "out" / "model-bf16.gguf"
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias"} <= names
    ref = reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() < 3e-2


def test_qwen3_with_per_head_norms_runs_like_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=BPE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads: written as key/value length
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    model = save_random_causal_lm(config, tmp_path / "ckpt", seed=2)
    result, _ = export_gguf(tmp_path / "ckpt", tmp_path / "out", "f32")
    path = tmp_path / "out" / "model-f32.gguf"
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.architecture") == "qwen3"
    assert field(reader, "qwen3.attention.key_length") == 32
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types
    ref = reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() < 1e-4
    assert result.summary["verification"]["tensors_checked"] == len(types)


def test_llama3_rope_scaling_writes_rope_freqs_as_transformers_scales(tmp_path: Path) -> None:
    """``rope_freqs`` = default inverse frequencies / transformers' llama3-scaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(
        vocab_size=BPE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters=rope,
        architectures=["LlamaForCausalLM"],
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "ckpt"))
    result, _ = export_gguf(tmp_path / "ckpt", tmp_path / "out", "q8_0")
    written = tensors(gguf.GGUFReader(tmp_path / "out" / "model-q8_0.gguf"))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert np.allclose(written["rope_freqs.weight"], (default / scaled).numpy(), rtol=1e-5)
    assert result.summary["verification"]["tensors_checked"] == len(written)
