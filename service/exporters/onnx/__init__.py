"""ONNX through torch's dynamo exporter.

``exporter`` (spec and exporter, registered at import), ``plan`` (the job's memory and disk),
``verify`` (parity of onnxruntime's outputs with PyTorch's), ``artifact_weights`` (an int4/int8
file's own weights for PyTorch's side, each held to the source's) and ``ort_cli`` (onnxruntime
run in a child process).
"""

from service.exporters.onnx.exporter import ONNXExporter, ONNXSpec

__all__ = ["ONNXExporter", "ONNXSpec"]
