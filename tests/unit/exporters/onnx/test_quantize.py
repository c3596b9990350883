"""int4/int8 weights for ONNX: the streamed quantizer writes onnxruntime's bytes, the
dequantization the checks use is what onnxruntime's MatMulNBits multiplies by, and the request
fields are validated at submission."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    DefaultWeightOnlyQuantizer,
)
from pydantic import ValidationError

from service.errors import UnsupportedExport
from service.exporters.onnx.exporter import ONNXExporter, ONNXSpec
from service.exporters.onnx.quantize import PARTS, NBits, NBitsWeight, dequantize
from tests.fixtures.models import tiny_bert_config

SCHEMES = [NBits(b, s, sym) for b in (4, 8) for s in (32, 128) for sym in (True, False)]


def _weight(n: int = 40, k: int = 200) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((n, k)).astype(np.float32)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_streamed_weight_writes_onnxruntime_quantizers_bytes_slice_by_slice(
    scheme: NBits, tmp_path: Any
) -> None:
    w = _weight()  # torch layout [N, K]; onnxruntime quantizes B = W^T [K, N]
    reads: list[tuple[int, int]] = []

    def rows(start: int, stop: int) -> np.ndarray:
        reads.append((start, stop))
        return w[start:stop]

    streamed = NBitsWeight("w", 40, 200, scheme, rows, 4, tmp_path)
    streamed._step = 9  # slices of 9 rows: blocks never straddle a slice
    config = DefaultWeightOnlyQuantConfig(
        block_size=scheme.block_size, is_symmetric=scheme.symmetric, bits=scheme.bits
    )
    expected = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(w.T))
    written = {}
    for part in streamed.parts():
        buffer = io.BytesIO()
        streamed.write(part, buffer)
        written[part] = buffer.getvalue()
    assert max(b - a for a, b in reads) == 9 and len(reads) == 5  # one pass, never the whole
    for part, want in zip(PARTS, expected, strict=False):
        if part in written:
            assert written[part] == want.tobytes(), part
    assert not list(tmp_path.iterdir())  # the spooled parts were copied and deleted


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequantized_weight_is_what_matmulnbits_multiplies_by(scheme: NBits) -> None:
    n, k = 24, 200
    w = _weight(n, k)
    parts = scheme.quantize_rows(w)
    inputs = ["x", "packed", "scales"] + ([] if scheme.symmetric else ["zp"])
    node = helper.make_node(
        "MatMulNBits", inputs, ["y"], domain="com.microsoft",
        K=k, N=n, bits=scheme.bits, block_size=scheme.block_size,
    )  # fmt: skip
    inits = [numpy_helper.from_array(parts["packed"], "packed"),
             numpy_helper.from_array(parts["scales"], "scales"),
             numpy_helper.from_array(parts["zero_points"], "zp")][: len(inputs) - 1]  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])], inits,
    )  # fmt: skip
    model = helper.make_model(
        graph,
        ir_version=10,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": np.eye(k, dtype=np.float32)})  # identity in: W^T out
    zero = None if scheme.symmetric else parts["zero_points"]
    ours = dequantize(scheme, k, parts["packed"], parts["scales"], zero)
    np.testing.assert_allclose(ours, y.T, rtol=0, atol=1e-6)
    assert np.abs(ours - w).max() < np.abs(w).max() / (2 ** (scheme.bits - 1) - 1)


def test_quantization_fields_default_to_the_model_builders_and_need_quantized_weights() -> None:
    assert ONNXSpec(weights="int4").nbits() == NBits(4, 32, True)
    assert ONNXSpec(weights="int8", block_size=128, symmetric=False).nbits() == NBits(8, 128, False)
    assert ONNXSpec().nbits() is None
    with pytest.raises(ValidationError, match="block_size"):
        ONNXSpec(block_size=32)
    with pytest.raises(ValidationError):
        ONNXSpec(weights="int4", block_size=48)
    with pytest.raises(ValidationError):
        ONNXSpec(layout="onnx")


@pytest.mark.parametrize("spec", [ONNXSpec(weights="int4"), ONNXSpec(layout="genai")])
def test_encoder_refuses_quantized_weights_and_a_layout(spec: ONNXSpec) -> None:
    config = tiny_bert_config().to_dict() | {"architectures": ["BertModel"]}
    with pytest.raises(UnsupportedExport, match="causal LMs"):
        ONNXExporter().check(spec, config)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequantize_slice_by_slice_is_dequantize_whole(scheme: NBits, tmp_path: Any) -> None:
    w = _weight(n=23)
    parts = NBits.quantize_rows(scheme, w)
    zero = None if scheme.symmetric else parts["zero_points"]
    whole = dequantize(scheme, 200, parts["packed"], parts["scales"], zero, rows_per_slice=23)
    sliced = dequantize(scheme, 200, parts["packed"], parts["scales"], zero, rows_per_slice=5)
    assert sliced.dtype == np.float32 and np.array_equal(whole, sliced)


def _tied_graph(w: np.ndarray) -> Any:
    """``emb = Gather(W, ids)`` and ``y = MatMul(x, Transpose(W))``: a head tied to the
    embedding, as torch.onnx captures it."""
    import onnx_ir as ir

    v, k = w.shape
    nodes = [
        helper.make_node("Gather", ["W", "ids"], ["emb"], name="embedding"),
        helper.make_node("Transpose", ["W"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w_t"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes, "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [3, k]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, v])],
        [numpy_helper.from_array(w, "W")],
    )  # fmt: skip
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    return ir.from_proto(proto)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_tied_int4_embedding_gathers_the_heads_blocks_as_the_model_builder_does(
    scheme: NBits, tmp_path: Any
) -> None:
    import onnx_ir as ir

    from service.exporters.onnx.quantize import gather_quantized, quantize_matmuls

    w = _weight(n=50, k=200)  # 200 is not a whole number of blocks: the padding is sliced off
    model = _tied_graph(w)
    done = quantize_matmuls(model.graph, scheme, lambda _: (lambda a, b: w[a:b], 4), tmp_path)
    gathered = gather_quantized(model.graph, scheme, done)
    ops = [node.op_type for node in model.graph]
    if scheme.bits == 8:  # the builder keeps a float embedding beside an int8 head
        assert gathered == [] and "Gather" in ops and "W" in model.graph.initializers
        return
    assert gathered == ["W"] and "W" not in model.graph.initializers
    assert "Gather" not in ops and ops.count("GatherBlockQuantized") == 1
    ir.save(model, tmp_path / "m.onnx", external_data="m.onnx_data")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray([49, 0, 7], dtype=np.int64)
    x = np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32)
    emb, y = session.run(["emb", "y"], {"ids": ids, "x": x})
    parts = scheme.quantize_rows(w)
    zero = None if scheme.symmetric else parts["zero_points"]
    ours = dequantize(scheme, 200, parts["packed"], parts["scales"], zero)
    assert emb.shape == (3, 200) and np.array_equal(emb, ours[ids])  # the rows, exactly
    np.testing.assert_allclose(y, x @ ours.T, rtol=0, atol=1e-4)  # the head reads the same
