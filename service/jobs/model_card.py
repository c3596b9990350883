"""The model card every job writes beside its manifest: ``README.md`` in the Hugging Face
model-card format, so the recipe and provenance travel with the files.

YAML front matter (the Hub's model-card metadata): ``base_model`` (the Hub repo of an
``hf://`` source), ``library_name`` (``gguf`` when a GGUF file is among the exports, else
``safetensors``, ``onnx`` or ``nnef``), ``tags`` (one per format, plus each quantization type)
and ``quantized_by``. Then, in Markdown: the source and the commit or digest it resolved to,
each export's recipe, the tool versions, each consumer check's figures (whatever numbers the
exporter recorded: perplexity ratio, tokenizer probes, tract / onnxruntime agreement, peak
memory) and the sha256 of an imatrix calibration text.

The card is rendered from the manifest alone (a pure function), so a reused job's card and a
published bucket's card say the same as its manifest. YAML is written with JSON-quoted
scalars, which YAML reads as they are (no dependency on a YAML library, no quoting surprises).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

CARD = "README.md"
QUANTIZED_BY = "modelprep"
_LIBRARY_ORDER = ("gguf", "safetensors", "onnx", "nnef")
_CHECK_KEYS = ("verify", "verification", "llama_cpp", "mtmd", "tract", "onnxruntime", "parity",
               "check", "checks")
"""Summary sections holding what a consumer of the file measured (``verification``: the GGUF
read-back against the source; ``mtmd``: llama.cpp's multimodal check of a projector)."""
_TOOLS = ("llama.cpp", "gguf", "torch-to-nnef", "tract", "onnx", "onnxruntime", "torch",
          "transformers", "safetensors", "modelprep")


def _q(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Scalar leaves of nested dicts as ``a.b.c`` paths (lists of scalars kept whole)."""
    if isinstance(value, Mapping):
        for key in sorted(value):
            yield from _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(v, Mapping | list) for v in value):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _base_model(source: Mapping[str, Any]) -> str | None:
    uri = str(source.get("uri", ""))
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://").strip("/")
    repo = source.get("repo_id")
    return str(repo) if repo else None


def _imatrix_sha256(export: Mapping[str, Any]) -> str | None:
    imatrix = export.get("imatrix")
    if isinstance(imatrix, Mapping):
        if isinstance(imatrix.get("calibration"), str):
            return hashlib.sha256(imatrix["calibration"].encode()).hexdigest()
        if imatrix.get("sha256"):
            return str(imatrix["sha256"])
    return None


def render(manifest: Mapping[str, Any], tools: Mapping[str, str | None]) -> str:
    """The card of a job's ``manifest`` (as written by the pipeline), with the versions of the
    tools that produced and checked its files."""
    source: Mapping[str, Any] = manifest.get("source") or {}
    recipe: Mapping[str, Any] = manifest.get("recipe") or {}
    summaries: list[Mapping[str, Any]] = list(manifest.get("exports") or [])
    # Each summary holds its export's spec as validated (defaults spelled out).
    exports: list[Mapping[str, Any]] = [s["spec"] for s in summaries if "spec" in s] \
        or list(recipe.get("exports") or [])
    formats = [str(e.get("format")) for e in exports]
    library = next((f for f in _LIBRARY_ORDER if f in formats), formats[0] if formats else None)
    tags: list[str] = []
    for export in exports:
        for tag in (str(export.get("format")), export.get("type"), export.get("dtype"),
                    export.get("compression")):
            if isinstance(tag, str) and tag and tag not in tags:
                tags.append(tag)
    tags.append(QUANTIZED_BY)

    lines = ["---"]
    base = _base_model(source)
    if base:
        lines.append(f"base_model: {_q(base)}")
    if library:
        lines.append(f"library_name: {_q(library)}")
    lines.append("tags:")
    lines.extend(f"- {_q(t)}" for t in tags)
    lines.append(f"quantized_by: {_q(QUANTIZED_BY)}")
    lines.append("---")
    title = base or str(source.get("uri", "model"))
    lines += ["", f"# {title}: {', '.join(formats) or 'no exports'}", ""]
    lines.append(f"Prepared by modelprep, job `{manifest.get('job_id', '')}`.")
    lines += ["", "## Source", ""]
    lines.append(f"- URI: `{source.get('uri', '')}`")
    for key, label in (("revision", "Resolved commit or digest"), ("digest", "Objects digest"),
                       ("sha256", "sha256"), ("format", "Checkpoint format")):
        if source.get(key):
            lines.append(f"- {label}: `{source[key]}`")
    model: Mapping[str, Any] = manifest.get("model") or {}
    for key in ("architecture", "model_type", "parameter_count", "tensor_count", "dtype"):
        if model.get(key) is not None:
            lines.append(f"- {key.replace('_', ' ').capitalize()}: `{model[key]}`")

    lines += ["", "## Exports", ""]
    for i, export in enumerate(exports):
        summary = summaries[i] if i < len(summaries) else {}
        lines += [f"### {i + 1}. {export.get('format')}", "", "Recipe:", "", "```json",
                  json.dumps(export, indent=2, sort_keys=True), "```", ""]
        imatrix = _imatrix_sha256(export)
        if imatrix:
            lines += [f"Importance matrix calibration sha256: `{imatrix}`", ""]
        if summary.get("dir"):
            lines += [f"Files under `{summary['dir']}/`.", ""]
        figures = [
            (path, value)
            for key in _CHECK_KEYS if key in summary
            for path, value in _flatten(summary[key], key)
        ]
        figures += [(k, v) for k, v in summary.items()
                    if k.endswith(("_peak_rss_bytes", "peak_rss_bytes")) and not
                    isinstance(v, Mapping | list)]
        if figures:
            lines += ["| check | value |", "|---|---|"]
            lines += [f"| `{path}` | `{json.dumps(value)}` |" for path, value in figures]
            lines.append("")

    lines += ["## Tool versions", "", "| tool | version |", "|---|---|"]
    # the usual tools first, then any other a format declares (Exporter.producers), as given
    for name in [*(n for n in _TOOLS if n in tools), *(n for n in tools if n not in _TOOLS)]:
        if tools.get(name):
            lines.append(f"| {name} | `{tools[name]}` |")
    lines += ["", "## Files", "", "| path | bytes | sha256 |", "|---|---|---|"]
    for entry in manifest.get("files") or []:
        if isinstance(entry, Mapping):
            lines.append(f"| `{entry.get('path')}` | {entry.get('size')} | "
                         f"`{entry.get('sha256')}` |")
    return "\n".join(lines) + "\n"
