"""Export formats; importing this package registers every built-in exporter.

Each format is a package whose ``exporter`` module registers itself at import and keeps its
heavy imports (gguf, torch_to_nnef, tract) inside functions, so the API process can validate
and plan specs cheaply. The one line a new format adds outside its package is its import here.
"""

from service.exporters import gguf as _gguf  # noqa: F401
from service.exporters import nnef as _nnef  # noqa: F401
from service.exporters import onnx as _onnx  # noqa: F401
from service.exporters import safetensors as _safetensors  # noqa: F401
from service.exporters.base import (
    Exporter,
    ExportInputs,
    ExportResult,
    ExportSpec,
    exporter_for,
    plan_export,
    registry,
)

__all__ = [
    "ExportInputs", "ExportResult", "ExportSpec", "Exporter", "exporter_for", "plan_export",
    "registry",
]  # fmt: skip
