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
