"""llama.cpp's KL file format: the reference's logits written for ``llama-perplexity``, and
the figures it prints read back.

:func:`write_llama_base_logits` writes the reference's log-probabilities in
``llama-perplexity``'s base file (``--kl-divergence-base``; read back by ``--kl-divergence``),
whose format is ``_logits_``, ``uint32 n_ctx``, ``int32 n_vocab``, ``int32 n_chunk``, the
``int32`` tokens of every chunk, then per chunk and scored position ``nv = 2*ceil(n_vocab/2)+4``
``uint16``: two float32 (``scale``, ``min_log_prob``) and each token's log-probability as
``round((logit - min_logit) / scale)`` where ``min_logit = max(min, max - 16)``; and
:func:`parse_llama_kl` reads the figures it prints (:class:`~service.verification.logits.
LogitFigures`, defined as :mod:`service.verification.logits` defines them). numpy only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from service.verification.logits import LogitFigures, scored

MAGIC = b"_logits_"

LOG_PROB_FLOOR = 16.0
"""llama.cpp keeps log-probabilities down to ``max - 16`` nats; lower ones are stored as 0."""


def write_llama_base_logits(
    path: Path,
    chunks: np.ndarray,
    n_vocab: int,
    logits: Iterable[np.ndarray],
    excluded: np.ndarray | None = None,
) -> None:
    """``llama-perplexity --kl-divergence-base`` file of the reference: ``chunks`` the tokens
    ``(n_chunk, n_ctx)``, ``logits`` the reference's ``(n_ctx, >= n_vocab)`` for each chunk.

    ``excluded`` (one bool per scored position, chunk by chunk) makes those positions count as
    disagreeing in the tool's "Same top p": each such row is written with the reference's
    *least* likely token first, which no file close enough to matter puts first. The tool
    prints no per-position figures, so this is how it counts top-1 agreement on a subset (the
    quality report's decided positions: agreement = same top p x positions / kept); the other
    figures of such a run mean nothing."""
    n_chunk, n_ctx = chunks.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    window = scored(n_ctx)
    per_chunk = window.stop - window.start
    with path.open("wb") as out:
        out.write(MAGIC)
        out.write(np.asarray([n_ctx], dtype=np.uint32).tobytes())
        out.write(np.asarray([n_vocab, n_chunk], dtype=np.int32).tobytes())
        out.write(np.ascontiguousarray(chunks, dtype=np.int32).tobytes())
        for i, chunk_logits in enumerate(logits):
            rows = np.asarray(chunk_logits, dtype=np.float32)[window, :n_vocab]
            if excluded is not None:
                drop = excluded[i * per_chunk : (i + 1) * per_chunk]
                if drop.any():
                    rows = rows.copy()
                    low = rows[drop].argmin(axis=-1)
                    rows[drop] = rows[drop].min(axis=-1, keepdims=True)
                    rows[np.flatnonzero(drop), low] += 1.0
            out.write(_encode_rows(rows, nv).tobytes())

def _encode_rows(rows: np.ndarray, nv: int) -> np.ndarray:
    """Each row of logits as llama.cpp's quantized log-probabilities (``nv`` uint16 a row)."""
    n, n_vocab = rows.shape
    top = rows.max(axis=1)
    low = np.maximum(rows.min(axis=1), top - LOG_PROB_FLOOR)
    log_sum_exp = np.log(np.exp((rows - top[:, None]).astype(np.float64)).sum(axis=1))
    min_log_prob = (low - top - log_sum_exp).astype(np.float32)
    scale = ((top - low) / 65535.0).astype(np.float32)
    encoded = np.zeros((n, nv), dtype=np.uint16)
    header = np.stack([scale, min_log_prob], axis=1).astype(np.float32)
    encoded[:, :4] = header.view(np.uint16).reshape(n, 4)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.rint((rows - low[:, None]) * (1.0 / safe)[:, None])
    q = np.where((rows > low[:, None]) & (scale[:, None] > 0), q, 0)
    encoded[:, 4 : 4 + n_vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return encoded


_FIGURE = r"\s*([-+0-9.eE]+|nan|inf|-nan)"

_LLAMA_LINES = {
    "kl_mean": re.compile(r"Mean\s+KLD:" + _FIGURE),
    "kl_p99": re.compile(r"99\.0%\s+KLD:" + _FIGURE),
    "ppl_ratio": re.compile(r"Mean PPL\(Q\)/PPL\(base\)\s*:" + _FIGURE),
    "top1": re.compile(r"Same top p:" + _FIGURE),
}


def parse_llama_kl(output: str, positions: int) -> LogitFigures | None:
    """The figures ``llama-perplexity --kl-divergence`` printed (its summary, which it prints
    from 100 scored positions on), or None when a line is missing."""
    values: dict[str, float] = {}
    for key, pattern in _LLAMA_LINES.items():
        found = pattern.findall(output)
        if not found:
            return None
        values[key] = float(found[-1])
    return LogitFigures(
        kl_mean=values["kl_mean"],
        kl_p99=values["kl_p99"],
        top1=values["top1"] / 100.0,
        ppl_ratio=values["ppl_ratio"],
        positions=positions,
    )
