"""GGUF of more families, each checked by llama.cpp itself against transformers.

Real models where the corpus has one (Gemma 3 in test_consumers.py, all-MiniLM-L6-v2 here: a BERT
encoder whose pooled embedding from ``llama-embedding`` must equal transformers'); for families
with no small real model in the corpus (Mixtral, Qwen2-MoE, Phi-3), a tiny random model of the
real configuration class, saved by transformers with SmolLM2's real tokenizer, must continue a
prompt in ``llama-simple`` with the same greedy tokens as transformers' ``generate``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from service.shims.llama_cpp import llama_cpp_tool
from tests.fixtures.real_models import real_model
from tests.integration.real_models.test_consumers import (
    PROBES,
    PROMPT,
    assert_same_continuation,
    hf_greedy,
    llama_greedy,
    llama_tokenize,
    run_job,
)

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        **SMALL,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "phi3": {**SMALL, "num_key_value_heads": 4, "pad_token_id": 0},
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "phi3": "Phi3ForCausalLM"}  # fmt: skip
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "phi3": "phi3"}


SPM_FAMILIES = {"phi3"}
"""Families whose llama.cpp converter reads a SentencePiece ``tokenizer.model`` (Phi-3 ships
Llama-2's); the others get SmolLM2's real byte-level BPE."""


def _spm_tokenizer(out: Path) -> tuple[int, int]:
    """A real SentencePiece BPE with byte fallback trained offline; (vocab size, number of
    leading ids generation must avoid)."""
    from transformers import LlamaTokenizer

    from tests.fixtures.models import CORPUS, train_sentencepiece

    work = out.parent / "spm"
    work.mkdir(parents=True, exist_ok=True)
    model_file = train_sentencepiece(
        work / "tok", 340, [*CORPUS, PROMPT + " Paris."] * 3,
        control_symbols=["<|endoftext|>"],  # llama.cpp's phi3 vocabulary expects Phi-3's own
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    LlamaTokenizer.from_pretrained(str(work), vocab_file=str(model_file)).save_pretrained(
        str(out)
    )
    shutil.copy(model_file, out / "tokenizer.model")
    return 340, 4 + 256  # unk, bos, eos, <|endoftext|>, then the 256 byte pieces


def _tiny_random(family: str, out: Path) -> Path:
    """A random model of ``family``'s real config class with a real tokenizer."""
    if family in SPM_FAMILIES:
        vocab, controls = _spm_tokenizer(out)
    else:
        tokenizer_dir = real_model("smollm2")
        vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
        controls = 17
    config = AutoConfig.for_model(
        family, vocab_size=vocab, architectures=[ARCHITECTURES[family]], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, **FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
        # control tokens are never the greedy choice (llama.cpp stops at an end-of-generation
        # token where transformers' generate may not), nor byte pieces (half a UTF-8 character
        # is no text to compare)
        head = model.get_output_embeddings().weight
        head *= 4  # decisive logits: the greedy choice is no near-tie that rounding could flip
        head[:controls] = 0.0
    model.save_pretrained(str(out))
    if family not in SPM_FAMILIES:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_random_family_generates_in_llama_cpp_like_transformers(
    family: str, tmp_path: Path
) -> None:
    source = _tiny_random(family, tmp_path / family)
    artifacts, manifest = run_job(tmp_path / "job", source, [{"format": "gguf", "type": "f32"}])
    (export,) = manifest["exports"]
    assert export["architecture"] == GGUF_ARCH[family]
    assert export["hf_architecture"] == ARCHITECTURES[family]
    if family in SPM_FAMILIES:
        assert export["tokenizer"]["model"] == "llama"
    else:
        assert export["tokenizer"]["pre"] == "smollm"
    (gguf_file,) = (artifacts / "gguf").glob("*.gguf")
    ids, hf_text = hf_greedy(source, PROMPT, 6)
    assert all(i >= 4 for i in ids), ids
    assert_same_continuation(llama_greedy(gguf_file, PROMPT, 6), hf_text)


EMBEDDING_ATTEMPTS = 8
"""llama-embedding prints its JSON through llama.cpp's asynchronous logger, which the pinned
llama.cpp leaks at exit (upstream issue 22142, as ``gguf.llama_check._ATTEMPTS``): the tail of
the document is lost about one run in six here (exit 0, stdout cut mid-array). A cut document
never parses (its closing brackets are the last lines queued), so it is run again."""


def _llama_embedding(gguf_file: Path, text: str) -> np.ndarray:
    argv = [str(llama_cpp_tool("llama-embedding")), "-m", str(gguf_file), "-p", text,
            "--pooling", "mean", "--embd-normalize", "2", "--embd-output-format", "json",
            "--embd-separator", "<#no-separator#>",  # the default, a newline, splits the prompt
            "-t", "2"]  # (--log-disable would silence the JSON too)  # fmt: skip
    for _ in range(EMBEDDING_ATTEMPTS):
        out = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=True
        )
        try:
            data = json.loads(out.stdout[out.stdout.index("{") :])
        except ValueError:  # no "{" or a cut document
            continue
        got = np.asarray(data["data"][0]["embedding"], dtype=np.float64)
        assert np.isfinite(got).all(), got
        return got
    raise AssertionError(f"llama-embedding gave no whole JSON in {EMBEDDING_ATTEMPTS} runs: "
                         f"{out.stdout[-300:]!r}")  # fmt: skip


@pytest.mark.timeout(900)
def test_gguf_of_real_minilm_embeds_in_llama_cpp_like_transformers(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 (BertModel): llama.cpp's mean-pooled, normalized sentence embedding is
    sentence-transformers' (mean of the last hidden state over tokens, L2-normalized)."""
    source = real_model("minilm")
    artifacts, manifest = run_job(tmp_path, source, [{"format": "gguf", "type": "f16"}])
    (export,) = manifest["exports"]
    assert export["architecture"] == "bert" and export["tokenizer"]["model"] == "bert"
    (gguf_file,) = (artifacts / "gguf").glob("*.gguf")
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    for label, text in PROBES.items():
        expected = tok(text, add_special_tokens=False).input_ids
        assert llama_tokenize(gguf_file, text, tmp_path) == expected, label
        batch = tok(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        ref = hidden.mean(0).numpy().astype(np.float64)
        ref /= np.linalg.norm(ref)
        got = _llama_embedding(gguf_file, text)
        assert float(got @ ref) > 0.999, label
