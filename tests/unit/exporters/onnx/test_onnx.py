"""ONNX export checks at submission: the task an architecture exports as, and what is refused
(422) before any work. Exports run by onnxruntime are tests/integration/exporters/test_onnx.py."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.errors import http_status
from service.errors import UnsupportedExport
from service.exporters.onnx.exporter import (
    ONNXExporter,
    ONNXSpec,
    resolve_task,
)
from tests.fixtures.models import (
    tiny_bert_config,
    tiny_llama_config,
)


def _config(kind: str, **changes: Any) -> dict[str, Any]:
    config = (tiny_llama_config() if kind == "llama" else tiny_bert_config()).to_dict()
    config["architectures"] = ["LlamaForCausalLM"] if kind == "llama" else ["BertModel"]
    return config | changes


def test_task_defaults_from_the_architecture() -> None:
    assert resolve_task(_config("llama"), None) == "text-generation-with-past"
    assert resolve_task(_config("bert"), None) == "feature-extraction"


@pytest.mark.parametrize(
    "config,task,match",
    [
        (_config("llama"), "feature-extraction", "exports as 'text-generation-with-past'"),
        (_config("bert"), "text-generation-with-past", "exports as 'feature-extraction'"),
        (_config("llama", model_type="gpt2", architectures=["GPT2LMHeadModel"]), None, "gpt2"),
        (_config("bert", model_type="t5", architectures=["T5Model"]), None, "t5"),
    ],
)
def test_unsupported_task_or_architecture_is_refused_with_422(
    config: dict[str, Any], task: Any, match: str
) -> None:
    with pytest.raises(UnsupportedExport, match=match) as info:
        ONNXExporter().check(ONNXSpec(task=task), config)
    assert http_status(info.value) == 422


def test_a_checkpoint_without_config_is_refused() -> None:
    with pytest.raises(UnsupportedExport, match="config.json"):
        ONNXExporter().check(ONNXSpec(), None)


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantized_weights_for_a_moe_are_refused_naming_the_family(
    model_type: str, weights: str
) -> None:
    config = _config("llama", model_type=model_type, architectures=["MixtralForCausalLM"])
    ONNXExporter().check(ONNXSpec(), config)  # float weights are taken
    with pytest.raises(UnsupportedExport, match=f"MoE family '{model_type}'") as info:
        ONNXExporter().check(ONNXSpec(weights=weights), config)
    assert http_status(info.value) == 422


@pytest.mark.parametrize(
    "model_type,genai_type",
    [("gemma3_text", "gemma3_text"), ("phi3", "phi3"), ("olmo2", "decoder"),
     ("falcon", "decoder"), ("mixtral", "decoder")],
)  # fmt: skip
def test_genai_config_names_a_type_onnxruntime_genai_runs(
    model_type: str, genai_type: str, tmp_path: Any
) -> None:
    """A family onnxruntime-genai lists keeps its name; another is its generic "decoder" (its
    own name would be refused when og.Model loads the package)."""
    from service.exporters.onnx.genai import genai_config

    config = _config("llama", model_type=model_type)
    written = genai_config(config, {"input_ids": [], "attention_mask": []}, tmp_path, "model.onnx")
    assert written["model"]["type"] == genai_type
