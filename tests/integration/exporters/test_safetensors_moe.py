"""A mixture of experts exports to safetensors in either expert layout and reloads in transformers.

transformers 5's Mixtral, Qwen2-MoE and Qwen3-MoE modules hold a layer's experts packed
(``mlp.experts.gate_up_proj``); ``save_pretrained`` writes one tensor per expert unless told
``save_original_format=False``. For each family, a checkpoint in each layout goes through one
verified job with two safetensors exports: the default (the source's layout) and the other
one. Each export passes the job's reference check, holds exactly the tensors transformers'
own ``save_pretrained`` writes in that layout (bit-equal), and ``from_pretrained`` computes
the source's logits from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.fixtures.moe import MOE_FAMILIES, tiny_moe
from tests.integration.real_models.test_consumers import run_job

LAYOUTS = ("per_expert", "packed")
OTHER = {"per_expert": "packed", "packed": "per_expert"}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        stored.update(load_file(f))
    return stored


def _logits(directory: Path) -> torch.Tensor:
    ids = torch.tensor([[11, 40, 123, 77, 5, 9, 250]])
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_moe_exports_in_its_own_and_the_other_expert_layout(
    family: str, layout: str, tmp_path: Path
) -> None:
    source = tiny_moe(family, layout)
    exports: list[dict[str, Any]] = [
        {"format": "safetensors"},
        {"format": "safetensors", "experts": OTHER[layout]},
    ]
    artifacts, manifest = run_job(tmp_path, source, exports)
    want = _logits(source)
    for summary, written in zip(manifest["exports"], (layout, OTHER[layout]), strict=True):
        assert summary["experts"] == written, summary
        assert summary["verify"]["passed"], summary["verify"]
        out = artifacts / summary["dir"]
        # transformers' own save_pretrained of the same weights in that layout, tensor by tensor
        expected = _tensors(tiny_moe(family, written))
        got = _tensors(out)
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[n], expected[n]) for n in expected), [
            n for n in expected if not torch.equal(got[n], expected[n])
        ]
        assert torch.equal(_logits(out), want)
