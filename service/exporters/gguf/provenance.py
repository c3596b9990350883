"""The recipe and provenance of a GGUF file, in llama.cpp's own ``general.*`` keys: written
into the text model, its projector and its LoRA alike (``exporter``, ``lora``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.exporters.gguf.spec import GGUFSpec


def add_provenance(writer: Any, spec: GGUFSpec, source: dict[str, Any]) -> None:
    """The recipe and provenance in llama.cpp's own ``general.*`` keys (the model card says the
    same beside the file): ``general.quantized_by``, ``general.source.url`` (the source as the
    job stored it: no query string, no secret) and ``general.description`` holding the
    validated export spec and the resolved commit or digest. llama-quantize copies these keys
    into the files it writes. Keys the converter already set are left as they are."""
    present = set(writer.kv_data[0])
    resolved = source.get("revision") or source.get("digest") or source.get("sha256")
    # what makes the file what it is: "verify" changes the checks, not one byte of the file
    recipe = json.dumps(
        spec.model_dump(mode="json", exclude={"verify"}), sort_keys=True, separators=(",", ":")
    )
    description = f"modelprep recipe {recipe}" + (f"; source at {resolved}" if resolved else "")
    values = {
        "general.quantized_by": "modelprep",
        "general.source.url": source.get("uri"),
        "general.description": description,
    }
    for key, value in values.items():
        if isinstance(value, str) and value and key not in present:
            writer.add_string(key, value)
