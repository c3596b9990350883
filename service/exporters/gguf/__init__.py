"""GGUF for llama.cpp.

``spec`` (the request), ``exporter`` (registered at import), ``layout`` (what the file holds,
decided by llama.cpp's converter from metadata), ``plan`` (what the job holds in memory and writes
to disk, from the checkpoint's headers), ``blocks`` (a tensor's source rows in row blocks),
``writer`` (the streamed writer), ``verify`` (the read-back verification), ``provenance`` (the
recipe in the file's ``general.*`` keys), ``directory`` (a GGUF header read without its
vocabulary), ``quantize`` (K-quants and imatrix by ``llama-quantize`` in a child process) and
``llama_check`` (tokenizer and perplexity checked by llama.cpp's own tools).
"""

from service.exporters.gguf.exporter import GGUFExporter
from service.exporters.gguf.spec import GGUFSpec

__all__ = ["GGUFExporter", "GGUFSpec"]
