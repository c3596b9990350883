"""service.verification.logits: the figures, and llama.cpp's base-logits file read back as llama.cpp
reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.verification.llama_kl import MAGIC, parse_llama_kl, write_llama_base_logits
from service.verification.logits import LogitBounds, chunk_tokens, compare_logits, scored


def _read_base(path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """The tokens and each scored row's log-probabilities, decoded as perplexity.cpp does."""
    raw = path.read_bytes()
    assert raw[:8] == MAGIC
    n_ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw, np.int32, 2, 12))
    tokens = np.frombuffer(raw, np.int32, n_ctx * n_chunk, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(raw, np.uint16, offset=20 + 4 * n_ctx * n_chunk).reshape(n_chunk, -1, nv)
    decoded = []
    for chunk in rows:
        head = chunk[:, :4].copy().view(np.float32)  # scale, min_log_prob
        decoded.append(head[:, :1] * chunk[:, 4 : 4 + n_vocab] + head[:, 1:2])
    return tokens, decoded


def test_the_base_file_holds_the_reference_log_probabilities(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n_ctx, vocab = 16, 37
    chunks = chunk_tokens(rng.integers(0, vocab, 40), n_ctx, bos=1)
    assert chunks.shape == (2, n_ctx) and (chunks[:, 0] == 1).all()
    logits = [rng.normal(0, 3, (n_ctx, vocab)).astype(np.float32) for _ in chunks]
    write_llama_base_logits(tmp_path / "base", chunks, vocab, logits)
    tokens, decoded = _read_base(tmp_path / "base")
    assert (tokens == chunks).all()
    for got, x in zip(decoded, logits, strict=True):
        rows = x[scored(n_ctx)].astype(np.float64)
        expected = rows - rows.max(1, keepdims=True)
        expected -= np.log(np.exp(expected).sum(1, keepdims=True))
        kept = expected > expected.max(1, keepdims=True) - 16
        step = (rows.max(1) - rows.min(1)) / 65535
        assert (np.abs(got - expected)[kept] <= step.max()).all()


def test_identical_logits_score_zero_and_a_shuffled_vocabulary_fails_every_bound() -> None:
    rng = np.random.default_rng(1)
    chunks = chunk_tokens(rng.integers(0, 50, 64), 32)
    ref = [rng.normal(0, 4, (32, 50)) for _ in chunks]
    same = compare_logits(ref, ref, chunks)
    assert same.kl_mean < 1e-12 and same.top1 == 1.0 and abs(same.ppl_ratio - 1) < 1e-12
    shuffled = compare_logits(ref, [r[:, ::-1] for r in ref], chunks)
    bounds = LogitBounds(kl_mean=0.01, kl_p99=0.1, top1=0.9, ppl_ratio=1.1)
    assert len(bounds.violations(shuffled)) == 4 and not bounds.violations(same)


def test_llama_perplexity_summary_is_parsed() -> None:
    out = """
Mean PPL(Q)/PPL(base)         :   1.012345 ±   0.000900
Mean    KLD:   0.003022 ±   0.000231
99.0%   KLD:   0.015839
Same top p: 98.810 ± 0.685 %
"""
    figures = parse_llama_kl(out, 252)
    assert figures is not None
    assert (figures.kl_mean, figures.kl_p99, figures.ppl_ratio) == (0.003022, 0.015839, 1.012345)
    assert abs(figures.top1 - 0.9881) < 1e-9 and figures.positions == 252
    assert parse_llama_kl("chunk 1 only", 63) is None


def test_a_runtimes_window_rows_are_placed_where_they_are_scored_and_its_request_names_that_window() -> None:
    from service.verification.logits import placed_rows, scored, window_request

    chunks = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
    window = scored(16)
    request = window_request(chunks)
    assert request["chunks"].dtype == np.int64 and request["chunks"].tolist() == chunks.tolist()
    assert (int(request["first"]), int(request["last"])) == (window.start, window.stop)
    rows = [np.full((window.stop - window.start, 5), float(i + 1), np.float32) for i in range(2)]
    placed = placed_rows(rows, chunks)
    assert [p.shape for p in placed] == [(16, 5), (16, 5)]
    for i, p in enumerate(placed):
        assert (p[window] == i + 1).all()
        outside = np.ones(16, bool)
        outside[window] = False
        assert (p[outside] == 0).all()
