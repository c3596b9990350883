"""Safetensors in the Hugging Face layout, optionally cast: the smallest format, the template.

``exporter`` (spec and exporter, registered at import), ``plan`` (the job's memory and disk),
``writer`` (the streamed shards and index) and ``verify`` (the written model run again by
transformers and compared with the source's reference outputs, in the pipeline's VERIFY phase).
"""

from service.exporters.safetensors.exporter import SafetensorsExporter, SafetensorsSpec

__all__ = ["SafetensorsExporter", "SafetensorsSpec"]
