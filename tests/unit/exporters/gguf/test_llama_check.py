"""Reading llama.cpp's figures (``service.exporters.gguf.llama_check``): the perplexity bound per
type and the final estimate, from the tool's output as text.
"""

from __future__ import annotations

import pytest

from service.errors import VerificationFailed
from service.exporters.gguf.llama_check import (
    PPL_RATIO_BOUND,
    _estimate,
    check_perplexity,
)
from service.exporters.gguf.quantize import QUANTIZER_TYPES


def test_perplexity_beyond_the_type_bound_is_a_verification_failure() -> None:
    assert check_perplexity("Q6_K", 10.4, 10.0)["ratio"] == pytest.approx(1.04)
    with pytest.raises(VerificationFailed, match=r"Q6_K perplexity 10.600 is 1.06x"):
        check_perplexity("Q6_K", 10.6, 10.0)
    assert set(PPL_RATIO_BOUND) == set(QUANTIZER_TYPES.values())


def test_the_final_estimate_is_read_even_when_llama_cpp_loses_its_last_log_line() -> None:
    """The pinned llama.cpp leaks its logger at exit, so its last queued lines can be lost."""
    head = "perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=128\n"
    full = head + "[1]9.5,[2]9.1,[3]8.9,\nFinal estimate: PPL = 8.9000 +/- 0.3\n"
    assert _estimate(full) == "8.9000"
    assert _estimate(head + "[1]9.5,[2]9.1,[3]8.9,\n") == "8.9"
    assert _estimate(head + "[1]9.5,[2]9.1,") is None
