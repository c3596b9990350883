"""A linear layer as torch's exporter writes it, ``MatMul(x, Transpose(W))``, rewritten so that
onnxruntime reads the weight in place: same outputs, no transpose of any initializer left."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from service.exporters.onnx.mapped import ALIGNMENT, weights_read_in_place


def _linear_model(weight: np.ndarray) -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 3, 8]))
    w = ir.Value(name="linear.weight", const_value=ir.Tensor(weight, name="linear.weight"))
    w.shape, w.type = ir.Shape([16, 8]), ir.TensorType(ir.DataType.FLOAT)
    transpose = ir.Node("", "Transpose", [w], attributes=[ir.AttrInt64s("perm", [1, 0])])
    product = ir.Node("", "MatMul", [x, transpose.outputs[0]], name="linear")
    y = product.outputs[0]
    y.name, y.shape, y.type = "y", ir.Shape(["batch", 3, 16]), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [y], nodes=[transpose, product], initializers=[w], opset_imports={"": 18})
    return ir.Model(graph, ir_version=9)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": x})
    return np.asarray(y)


def test_a_linear_layer_reads_its_weight_in_place_with_the_same_outputs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 8)).astype(np.float32)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    ir.save(_linear_model(weight), tmp_path / "plain.onnx", external_data="plain.data")

    model = _linear_model(weight)
    assert weights_read_in_place(model.graph) == 1
    assert [n.op_type for n in model.graph] == ["Transpose", "MatMul", "Transpose"]
    assert all(not v.is_initializer() for n in model.graph if n.op_type == "Transpose"
               for v in n.inputs if v is not None)  # fmt: skip
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    assert matmul.inputs[0] is not None and matmul.inputs[0].name == "linear.weight"
    assert [o.name for o in model.graph.outputs] == ["y"]
    ir.save(model, tmp_path / "mapped.onnx", external_data="mapped.data", alignment=ALIGNMENT)

    np.testing.assert_allclose(
        _run(tmp_path / "mapped.onnx", x), x @ weight.T, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        _run(tmp_path / "mapped.onnx", x), _run(tmp_path / "plain.onnx", x), rtol=1e-5, atol=1e-6
    )


def test_a_weight_transposed_for_something_else_than_a_product_is_left_alone() -> None:
    model = _linear_model(np.zeros((16, 8), dtype=np.float32))
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    add = ir.Node("", "Add", [matmul.inputs[1], matmul.inputs[1]])
    model.graph.append(add)
    assert weights_read_in_place(model.graph) == 0
