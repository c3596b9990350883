"""The int4/int8 check's reference layer holds each weight it dequantizes from the artifact to
the source's: a correctly rounded weight is a fraction of the bound away, one quantized from
its rows upside down (a file consistent with itself, which onnxruntime agrees with) fails the
check naming the weight, and the block-by-block measure is the whole tensor's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from service.errors import VerificationFailed
from service.exporters.onnx import artifact_weights as aw
from service.exporters.onnx import blocks
from service.exporters.onnx.quantize import NBits
from service.verification.weight_error import WEIGHT_ERROR_BOUND

SCHEMES = [NBits(4, 32, True), NBits(4, 128, False), NBits(8, 32, True), NBits(8, 128, False)]
NAME = "model.layers.0.mlp.down_proj.weight"


def _layer(n: int = 48, k: int = 256) -> nn.Linear:
    layer = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02)
    return layer


def _parts(scheme: NBits, w: np.ndarray) -> tuple[Any, Any, Any]:
    q = scheme.quantize_rows(w)
    return q["packed"], q["scales"], None if scheme.symmetric else q["zero_points"]


def _run(layer: nn.Linear, scheme: NBits, w: np.ndarray, errors: aw.WeightErrors) -> None:
    forward = aw._dequantized_linear(layer, scheme, _parts(scheme, w), NAME, errors)
    forward(torch.randn(2, layer.in_features))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_correctly_quantized_weight_is_a_fraction_of_the_bound_from_the_source(
    scheme: NBits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "WRITE_BLOCK_BYTES", 256 * 4 * 5)  # blocks of 5 rows
    layer = _layer()
    errors = aw.WeightErrors(scheme.bits)
    _run(layer, scheme, layer.weight.detach().numpy(), errors)
    error = errors.errors[NAME]
    assert 0 < error < (0.2 if scheme.bits == 4 else 0.02) < WEIGHT_ERROR_BOUND, error
    assert errors.largest() == {"tensor": NAME, "relative_rms": error, "weights": 1}


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_weight_quantized_from_its_rows_upside_down_fails_naming_it(
    scheme: NBits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "WRITE_BLOCK_BYTES", 256 * 4 * 7)
    layer = _layer()
    flipped = layer.weight.detach().numpy()[::-1].copy()
    with pytest.raises(VerificationFailed, match=rf"{NAME}: the ONNX's int{scheme.bits} values"):
        _run(layer, scheme, flipped, aw.WeightErrors(scheme.bits))


def test_the_weight_is_measured_on_its_first_run_only() -> None:
    scheme = SCHEMES[0]
    layer = _layer()
    errors = aw.WeightErrors(scheme.bits)
    forward = aw._dequantized_linear(
        layer, scheme, _parts(scheme, layer.weight.detach().numpy()), NAME, errors
    )
    forward(torch.randn(1, layer.in_features))
    errors.errors[NAME] = -1.0  # a second run would overwrite it
    forward(torch.randn(1, layer.in_features))
    assert errors.errors[NAME] == -1.0
