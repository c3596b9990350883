"""An artifact's logits against a reference's on a fixed text: KL divergence, top-1, perplexity.

One set of figures for every consumer, defined as ``llama-perplexity --kl-divergence`` defines
them, so a GGUF judged by llama.cpp and an ONNX judged here read the same:

* the text is cut into chunks of ``n_ctx`` tokens, each evaluated from an empty context; only
  the positions of the second half of a chunk are scored (``n_ctx/2`` to ``n_ctx-2``: each
  sees at least half a chunk of context), predicting the next token of the text;
* ``kl_mean`` / ``kl_p99``: KL(reference || artifact) of the next-token distributions, mean
  and 99th percentile over the scored positions;
* ``top1``: the fraction of scored positions where both put the same token first;
* ``ppl_ratio``: perplexity(artifact) / perplexity(reference) on the text's own next tokens.

The same figures from llama.cpp's own run are read and written by
:mod:`service.verification.llama_kl`. numpy only: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

FIXED_TEXT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined movable metal type, oil-based ink and a screw press adapted from those used "
    "for wine. Books that had taken a scribe months to copy could now be produced by the hundred "
    "in weeks, and the price of a book fell so far that merchants, students and craftsmen could "
    "own them. Within fifty years presses were working in more than two hundred cities across "
    "Europe. The spread of printed pamphlets changed how news travelled, how arguments about "
    "religion and politics were conducted, and how scientists shared their observations. "
    "Standardised texts made it possible for a reader in Venice and a reader in London to refer "
    "to the same page of the same edition, which in turn encouraged the habit of citation and "
    "careful comparison. Spelling and grammar slowly settled as printers chose one form over "
    "another, and national languages gained prestige against Latin. Libraries grew, schools "
    "multiplied, and literacy rose steadily over the following centuries. Historians still argue "
    "about how much of the scientific revolution, the reformation and the rise of the modern "
    "state should be credited to the press, but few doubt that the cheap, reliable copying of "
    "words was one of the great turning points of human history. Today the same questions are "
    "asked about the internet, which once again lowered the cost of spreading ideas to almost "
    "nothing, and which has again been blamed for both enlightenment and confusion. "
) * 2
"""The fixed text every artifact's logits are judged on (about 600 tokens for a 32k-128k
vocabulary): plain English prose, which any language model predicts well above chance."""


def check_text(requested: str | None) -> str:
    """The text every logit check runs on: the request's ``verify_text``, repeated up to the
    fixed text's length when shorter (so llama-perplexity, which reads it itself, has its two
    chunks, and the reference's chunks are cut from the same string), else the fixed text."""
    if requested is None:
        return FIXED_TEXT
    if len(requested) >= len(FIXED_TEXT):
        return requested
    return "\n".join([requested] * (1 + len(FIXED_TEXT) // len(requested)))


@dataclass(frozen=True)
class LogitFigures:
    """How far an artifact's next-token distributions are from the reference's."""

    kl_mean: float
    kl_p99: float
    top1: float
    ppl_ratio: float
    positions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LogitBounds:
    """The worst figures an artifact may show and pass."""

    kl_mean: float
    kl_p99: float
    top1: float
    ppl_ratio: float

    def violations(self, figures: LogitFigures) -> list[str]:
        """What ``figures`` exceed, one phrase each (empty: within bounds)."""
        out = []
        if not figures.kl_mean <= self.kl_mean:  # NaN fails too
            out.append(f"mean KL {figures.kl_mean:.5f} > {self.kl_mean}")
        if not figures.kl_p99 <= self.kl_p99:
            out.append(f"p99 KL {figures.kl_p99:.5f} > {self.kl_p99}")
        if not figures.top1 >= self.top1:
            out.append(f"top-1 agreement {figures.top1:.4f} < {self.top1}")
        if not figures.ppl_ratio <= self.ppl_ratio:
            out.append(f"perplexity ratio {figures.ppl_ratio:.4f} > {self.ppl_ratio}")
        return out


RUNTIME_LOGIT_BOUNDS: dict[str, LogitBounds] = {
    "float32": LogitBounds(kl_mean=0.002, kl_p99=0.02, top1=0.97, ppl_ratio=1.02),
    "float16": LogitBounds(kl_mean=0.005, kl_p99=0.05, top1=0.95, ppl_ratio=1.03),
}
"""The worst figures a graph runtime's logits (onnxruntime for ONNX, tract for NNEF) may show
against transformers' float32 run of the source, by the dtype the graph computes in: the same
for both formats, so one model exported to both is held to one standard. float32 and float16
as the GGUF check's f32/f16 (``gguf.llama_check.CALIBRATED_FIGURES``) with room for a runtime's own
kernels. No bfloat16 row: neither graph computes in bfloat16 (ONNX's dtype is float32 or
float16, onnxruntime's CPU kernels having no bfloat16 matmul; NNEF widens a bfloat16 checkpoint
to float32, ``offloaded_model.export_dtype``), so such a row could be neither reached nor
measured. A misread or miswritten model lands at KL ~1-10."""


COMPRESSED_LOGIT_BOUNDS: dict[str, LogitBounds] = {
    "q4_0": LogitBounds(kl_mean=1.0, kl_p99=6.0, top1=0.5, ppl_ratio=2.0),
}
"""The worst figures tract's logits of a compressed NNEF archive may show against
transformers' float32 run of the source, by compression (whatever the dtype: the weights'
4-bit error dwarfs the graph's float rounding). torch-to-nnef's min-max q4_0 measured by
``bench/runtime_logit_bounds.py`` on whole models: SmolLM2-135M KL 0.37 (p99 1.25, top-1
0.667, perplexity ratio 1.14); on 2 of its layers 0.085 (0.88, 0.88). The bound is GGUF's q4_0
(``gguf.llama_check.CALIBRATED_FIGURES``), which holds llama.cpp's q4_0 of the same models (up to KL
0.58, p99 3.6 on Qwen2.5-0.5B, perplexity ratio 1.55 on Gemma 3), with the same reasoning:
loose because 4 bits of a small model are that poor, while a misread or miswritten archive
lands at top-1 near 0. A whole NNEF q4_0 archive checked by the export is no longer judged by
it: tract's logits are held exactly to PyTorch's run of the archive's own weights
(``exporters.nnef.exact``), and its quality only by the request's thresholds; it stays for
:func:`runtime_bounds`' callers without that reference."""


def runtime_bounds(dtype: str, compression: str | None = None) -> LogitBounds:
    """The bounds of a graph runtime's logits: :data:`COMPRESSED_LOGIT_BOUNDS` of
    ``compression`` when the weights are compressed, else :data:`RUNTIME_LOGIT_BOUNDS` of
    ``dtype`` (a dtype name, ``float16``; one not listed gets float16's)."""
    if compression is not None:
        return COMPRESSED_LOGIT_BOUNDS[compression]
    return RUNTIME_LOGIT_BOUNDS.get(dtype, RUNTIME_LOGIT_BOUNDS["float16"])


def chunk_tokens(tokens: Iterable[int], n_ctx: int, bos: int | None = None) -> np.ndarray:
    """The text's tokens as whole chunks ``(n_chunk, n_ctx)`` (a partial last chunk dropped);
    with ``bos`` each chunk starts with it, as llama.cpp evaluates a chunk when its vocabulary
    adds one (so the reference sees exactly what llama.cpp sees)."""
    ids = np.asarray(list(tokens), dtype=np.int32)
    n_chunk = len(ids) // n_ctx
    if n_chunk == 0:
        raise ValueError(f"{len(ids)} tokens do not make one chunk of {n_ctx}")
    chunks = ids[: n_chunk * n_ctx].reshape(n_chunk, n_ctx).copy()
    if bos is not None:
        chunks[:, 0] = bos
    return chunks


def scored(n_ctx: int) -> slice:
    """Positions of a chunk whose next-token distribution is scored."""
    return slice(n_ctx // 2, n_ctx - 1)


def window_request(chunks: np.ndarray) -> dict[str, np.ndarray]:
    """A graph runtime child's request for the logits of ``chunks``' scored positions (the
    chunks, and the window's first and last position): what onnxruntime and tract are sent."""
    window = scored(int(chunks.shape[1]))
    return {
        "chunks": np.asarray(chunks, dtype=np.int64),
        "first": np.asarray(window.start, dtype=np.int64),
        "last": np.asarray(window.stop, dtype=np.int64),
    }


def placed_rows(found: Iterable[np.ndarray], chunks: np.ndarray) -> list[np.ndarray]:
    """Each chunk's scored-window logits (as a runtime child returns them) placed in a full
    chunk of zeros, the shape :func:`compare_logits` takes; rows outside the window are never
    scored."""
    window = scored(int(chunks.shape[1]))
    out = []
    for rows in found:
        full = np.zeros((int(chunks.shape[1]), rows.shape[-1]), dtype=np.float32)
        full[window] = rows
        out.append(full)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x: np.ndarray = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def compare_logits(
    reference: Iterable[np.ndarray], artifact: Iterable[np.ndarray], chunks: np.ndarray
) -> LogitFigures:
    """The figures of ``artifact`` against ``reference``: both give, chunk by chunk, the logits
    ``(n_ctx, n_vocab)`` at every position of ``chunks`` (the tokens, ``(n_chunk, n_ctx)``)."""
    n_ctx = chunks.shape[1]
    window = scored(n_ctx)
    kls: list[np.ndarray] = []
    same = nll = nll_ref = 0.0
    for ref, art, tokens in zip(reference, artifact, chunks, strict=True):
        lp_ref = log_softmax(np.asarray(ref)[window])
        lp_art = log_softmax(np.asarray(art)[window])
        vocab = min(lp_ref.shape[-1], lp_art.shape[-1])  # padded vocabularies score as absent
        lp_ref, lp_art = lp_ref[:, :vocab], lp_art[:, :vocab]
        kls.append((np.exp(lp_ref) * (lp_ref - lp_art)).sum(axis=-1))
        same += float((lp_ref.argmax(-1) == lp_art.argmax(-1)).sum())
        nxt = tokens[window.start + 1 : window.stop + 1]
        rows = np.arange(len(nxt))
        nll += float(-lp_art[rows, nxt].sum())
        nll_ref += float(-lp_ref[rows, nxt].sum())
    kl = np.concatenate(kls)
    n = len(kl)
    return LogitFigures(
        kl_mean=float(kl.mean()),
        kl_p99=float(np.percentile(kl, 99)),
        top1=same / n,
        ppl_ratio=math.exp((nll - nll_ref) / n),
        positions=n,
    )








