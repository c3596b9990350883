"""Safetensors in the Hugging Face layout, optionally cast: the smallest format, the template.

``exporter`` (spec and exporter, registered at import), ``writer`` (the streamed shards and
index). Verified against the source's reference outputs by the pipeline's VERIFY phase
(``SafetensorsExporter.verify``, through :mod:`service.exporters.common.parity`).
"""

from service.exporters.safetensors.exporter import SafetensorsExporter, SafetensorsSpec

__all__ = ["SafetensorsExporter", "SafetensorsSpec"]
