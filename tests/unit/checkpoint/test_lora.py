"""The LoRA merge arithmetic and the adapters refused, on small hand-written adapter files
(PEFT's own adapters on real SmolLM2: tests/integration/real_models/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from service.checkpoint.lora import (
    LoraMergeReader,
    check_adapter_matches,
    open_adapter,
    plan_adapter,
)
from service.checkpoint.safetensors import SafetensorsReader
from service.errors import AdapterMismatch, UnsupportedAdapter
from service.jobs.spec import JobSpec

PREFIX = "base_model.model.model.layers.0.mlp.c_fc"


def _adapter(root: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}
    (root / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def test_fan_in_fan_out_merges_the_transposed_product_row_range_by_row_range(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 5)  # Conv1D layout: (in, out)
    a, b = torch.randn(2, 6), torch.randn(5, 2)  # lora_A (r, in), lora_B (out, r)
    save_file({"model.layers.0.mlp.c_fc.weight": w}, str(tmp_path / "model.safetensors"))
    adapter = _adapter(tmp_path / "adapter", {f"{PREFIX}.lora_A.weight": a,
                                              f"{PREFIX}.lora_B.weight": b},
                       fan_in_fan_out=True, use_rslora=True)  # fmt: skip
    reader = LoraMergeReader(
        SafetensorsReader([tmp_path / "model.safetensors"]), open_adapter(adapter)
    )
    want = w + (4 / 2**0.5) * (b @ a).T
    merged = reader.read("model.layers.0.mlp.c_fc.weight")
    torch.testing.assert_close(merged, want)
    assert torch.equal(torch.cat(list(reader.iter_chunks("model.layers.0.mlp.c_fc.weight", 40))),
                       merged.reshape(-1))  # fmt: skip
    assert reader.region("model.layers.0.mlp.c_fc.weight") is None


@pytest.mark.parametrize(
    ("tensors", "config", "says"),
    [
        ({f"{PREFIX}.lora_A.weight": torch.zeros(2, 6)}, {}, "has lora_A only"),
        ({f"{PREFIX}.lora_A.weight": torch.zeros(2, 6), f"{PREFIX}.lora_B.weight": torch.zeros(5, 2),
          "base_model.model.lm_head.weight": torch.zeros(5, 6)}, {}, "not a LoRA factor"),
        ({f"{PREFIX}.lora_A.weight": torch.zeros(2, 6), f"{PREFIX}.lora_B.weight": torch.zeros(5, 2)},
         {"use_dora": True}, "use_dora"),
        ({f"{PREFIX}.lora_A.weight": torch.zeros(3, 6), f"{PREFIX}.lora_B.weight": torch.zeros(5, 3)},
         {}, "not rank-2 factors"),
        ({f"{PREFIX}.lora_A.weight": torch.zeros(2, 6)}, {"peft_type": "IA3"}, "only LORA"),
    ],
)  # fmt: skip
def test_adapters_that_cannot_be_merged_exactly_are_refused_naming_why(
    tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], says: str
) -> None:
    with pytest.raises(UnsupportedAdapter, match=says):
        plan_adapter(_adapter(tmp_path, tensors, **config))


def test_the_first_mismatching_module_is_named(tmp_path: Path) -> None:
    plan = plan_adapter(_adapter(tmp_path, {f"{PREFIX}.lora_A.weight": torch.zeros(2, 6),
                                            f"{PREFIX}.lora_B.weight": torch.zeros(5, 2)}))  # fmt: skip
    check_adapter_matches(plan, {"model.layers.0.mlp.c_fc.weight": (5, 6)})
    with pytest.raises(AdapterMismatch, match=r"is 5x6 \(lora_B @ lora_A\), but the source's"):
        check_adapter_matches(plan, {"model.layers.0.mlp.c_fc.weight": (6, 5)})
    with pytest.raises(AdapterMismatch, match="the source has no tensor"):
        check_adapter_matches(plan, {})


def test_an_https_adapter_names_the_directory_of_its_two_files() -> None:
    from service.sources.adapter import adapter_urls

    want = {"adapter_config.json": "https://h/l/adapter_config.json?sig=1",
            "adapter_model.safetensors": "https://h/l/adapter_model.safetensors?sig=1"}
    for uri in ("https://h/l?sig=1", "https://h/l/?sig=1",
                "https://h/l/adapter_model.safetensors?sig=1"):
        assert adapter_urls(uri) == want, uri
    exports = [{"format": "safetensors"}]
    JobSpec.model_validate({"source": "file:///m", "adapter": "https://h/l/", "exports": exports})


def test_merge_false_needs_every_export_to_take_the_adapter_apart(tmp_path: Path) -> None:
    from service.config import Settings
    from service.errors import InvalidRequest, UnmergedAdapterUnsupported
    from service.jobs.service import check_spec

    settings = Settings(data_dir=tmp_path, local_roots=[tmp_path])
    lora = {"format": "gguf", "lora": True}

    def check(exports: list[dict[str, object]], **job: object) -> None:
        spec = JobSpec.model_validate({"source": "hf://o/m", "exports": exports, **job})
        check_spec(spec, settings, None, config_known=False)

    check([lora], adapter="hf://o/l", merge=False)
    check([{"format": "safetensors"}], adapter="hf://o/l")
    with pytest.raises(UnmergedAdapterUnsupported, match=r"exports\[1\] \(onnx\) cannot"):
        check([lora, {"format": "onnx"}], adapter="hf://o/l", merge=False)
    with pytest.raises(InvalidRequest, match='needs "adapter" and "merge": false'):
        check([lora], adapter="hf://o/l")
    with pytest.raises(InvalidRequest, match='needs "adapter"'):
        check([lora])
