"""How far a quantized file's stored weights are from the source's: relative RMS error, streamed.

An exact check runs the consumer against the file's *own* weights, so a file consistent with
itself but not with the source (a quantizer handed a weight's rows upside down) passes it, and
on a low-margin model its quality figures move by less than its rounding. Each stored weight,
dequantized, is therefore also compared with the source's (:data:`WEIGHT_ERROR_BOUND`): the
GGUF read-back (``exporters.gguf.artifact_weights``) and the ONNX int4/int8 reference
(``exporters.onnx.artifact_weights``) both measure with :class:`WeightError`, in the pieces they
already hold, never a whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from service.errors import VerificationFailed

if TYPE_CHECKING:
    import numpy as np

WEIGHT_ERROR_BOUND = 0.5
"""Largest relative RMS error (``||stored - source|| / ||source||``) of a weight a file holds.
A correct file's rounding is a fraction of its weights: q8_0 and int8 ~0.005, q4_0, Q4_K and
int4 ~0.1, Q2_K ~0.3 relative RMS on Gaussian weights; a fault moves whole rows or scales:
flipped or swapped rows sqrt(2), zeroed 1, a scale doubled 1."""

SUM_ELEMENTS = 1 << 20
"""Elements summed at once in float64: the temporaries stay a few MiB whatever the piece."""


class WeightError:
    """The relative RMS error of one tensor, accumulated piece by piece: :meth:`add` the
    stored values in row-major order, in pieces of any size; the source's values are pulled
    from ``source`` (flat pieces of any size, same order) as far as each piece needs."""

    def __init__(self, source: Iterator[np.ndarray]) -> None:
        self._source = source
        self._held: np.ndarray | None = None  # the tail of a source piece not yet compared
        self._err = self._ref = 0.0

    def add(self, stored: np.ndarray) -> None:
        """Compare the next ``stored`` values with as many of the source's."""
        flat = stored.reshape(-1)
        while flat.size:
            if self._held is None or not self._held.size:
                chunk = next(self._source, None)
                if chunk is None:
                    raise VerificationFailed("the file holds more values than the source tensor")
                self._held = chunk.reshape(-1)
            n = min(flat.size, self._held.size)
            self._sums(flat[:n], self._held[:n])
            flat, self._held = flat[n:], self._held[n:]

    def _sums(self, stored: np.ndarray, source: np.ndarray) -> None:
        import numpy as np

        for i in range(0, stored.size, SUM_ELEMENTS):
            a = np.asarray(stored[i : i + SUM_ELEMENTS], dtype=np.float64)
            b = np.asarray(source[i : i + SUM_ELEMENTS], dtype=np.float64)
            self._err += float(np.dot(a - b, a - b))
            self._ref += float(np.dot(b, b))

    @property
    def value(self) -> float:
        """``||stored - source|| / ||source||`` so far (0 when both are zero)."""
        if self._ref > 0:
            return math.sqrt(self._err / self._ref)
        return 0.0 if self._err == 0 else math.inf


def relative_error(stored: Iterator[np.ndarray], source: Iterator[np.ndarray]) -> float:
    """``||stored - source|| / ||source||`` over two flat float streams of the same tensor in
    row-major order, in pieces of any sizes (0 when both are zero)."""
    error = WeightError(source)
    for piece in stored:
        error.add(piece)
    return error.value
