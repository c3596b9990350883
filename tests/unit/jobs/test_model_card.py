"""The model card is rendered from a job's manifest: HF front matter, provenance, figures."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from service.jobs.model_card import render

MANIFEST: dict[str, Any] = {
    "job_id": "ab" * 16,
    "source": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "c0ffee" * 6,
               "format": "safetensors"},
    "recipe": {"exports": [{"format": "gguf"}, {"format": "safetensors"}]},
    "model": {"architecture": "LlamaForCausalLM", "parameter_count": 134515008},
    "exports": [
        {"format": "gguf", "dir": "gguf",
         "spec": {"format": "gguf", "type": "Q4_K_M",
                  "imatrix": {"calibration": "The quick brown fox."}},
         "quantizer_peak_rss_bytes": 123456,
         "llama_cpp": {"perplexity": {"ratio": 1.031, "bound": 1.1},
                       "tokenizer": {"probes": 12, "matched": 12}}},
        {"format": "safetensors", "dir": "safetensors",
         "spec": {"format": "safetensors", "dtype": "bfloat16"},
         "verify": {"max_abs_err": 0.0, "tensors": 272}},
    ],
    "files": [{"path": "gguf/model.gguf", "size": 10, "sha256": "0" * 64}],
}


def _front_matter(card: str) -> dict[str, Any]:
    """The YAML block, read as the Hub reads it (JSON-quoted scalars are valid YAML)."""
    head = card.split("---\n")[1]
    out: dict[str, Any] = {}
    key = ""
    for line in head.splitlines():
        if line.startswith("- "):
            out.setdefault(key, []).append(json.loads(line[2:]))
        else:
            key, _, value = line.partition(":")
            if value.strip():
                out[key] = json.loads(value)
    return out


def test_front_matter_names_base_model_library_tags_and_quantizer() -> None:
    card = render(MANIFEST, {"llama.cpp": "b6000", "torch": "2.13.0"})
    assert card.startswith("---\n")
    meta = _front_matter(card)
    assert meta == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "library_name": "gguf",
        "tags": ["gguf", "Q4_K_M", "safetensors", "bfloat16", "modelprep"],
        "quantized_by": "modelprep",
    }


def test_body_holds_provenance_recipes_figures_versions_and_imatrix_digest() -> None:
    card = render(MANIFEST, {"llama.cpp": "b6000", "torch": "2.13.0", "onnx": None})
    assert "c0ffee" * 6 in card
    assert '"type": "Q4_K_M"' in card
    assert "| `llama_cpp.perplexity.ratio` | `1.031` |" in card
    assert "| `llama_cpp.tokenizer.matched` | `12` |" in card
    assert "| `quantizer_peak_rss_bytes` | `123456` |" in card
    assert "| `verify.max_abs_err` | `0.0` |" in card
    assert "| llama.cpp | `b6000` |" in card and "| onnx |" not in card
    assert hashlib.sha256(b"The quick brown fox.").hexdigest() in card
    assert "| `gguf/model.gguf` | 10 | `" + "0" * 64 + "` |" in card


def test_a_non_hub_source_has_no_base_model() -> None:
    manifest = {**MANIFEST, "source": {"uri": "s3://models/llama", "digest": "d" * 64}}
    card = render(manifest, {})
    assert "base_model" not in _front_matter(card)
    assert "d" * 64 in card


def test_a_gguf_exports_read_back_and_projector_check_are_figures_too() -> None:
    """The GGUF exporter's own summary keys (service/exporters/gguf/exporter.py)."""
    gguf = {**MANIFEST["exports"][0],
            "verification": {"read_back": True, "tensors_checked": 30,
                             "max_abs_error": {"q8_0": 0.004}},
            "mtmd": {"agreed_tokens": 16, "tokens": 16}}
    card = render({**MANIFEST, "exports": [gguf]}, {})
    assert "| `verification.tensors_checked` | `30` |" in card
    assert "| `verification.max_abs_error.q8_0` | `0.004` |" in card
    assert "| `mtmd.agreed_tokens` | `16` |" in card
