"""NNEF for tract, through torch-to-nnef.

``exporter`` (spec and exporter, registered at import), ``plan`` (the job's memory and disk, and
whether tract checks the archive whole or block by block), ``verify`` (parity of tract's outputs
with PyTorch's) and ``tract_cli`` (the tract command run in a child process).
"""

from service.exporters.nnef.exporter import NNEFExporter, NNEFSpec

__all__ = ["NNEFExporter", "NNEFSpec"]
