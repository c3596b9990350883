"""NNEF for tract, through torch-to-nnef.

``exporter`` (spec and exporter, registered at import), ``plan`` (the job's memory and disk, and
whether tract checks the archive whole or block by block), ``verify`` (parity of tract's outputs
with PyTorch's), ``layerwise`` (the archive cut into blocks tract runs one at a time),
``tract_cli`` (the tract command run in a child process) and ``graph_text`` (the text surgery on
``graph.nnef`` that the job process and the child both do).
"""

from service.exporters.nnef.exporter import NNEFExporter, NNEFSpec

__all__ = ["NNEFExporter", "NNEFSpec"]
