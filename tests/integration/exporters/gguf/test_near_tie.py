"""A model whose next-token logits are near ties (random init of std 0.02, unit norms:
:mod:`tests.fixtures.near_tie`) through verified GGUF jobs (issue 35).

Its correct q8_0 and Q4_K_M files flip top-1 tokens against the float source by chance; the
jobs succeed, with the quality report (KL, top-1, near ties, top-1 on decided positions) in the
manifest, and the exact check (llama.cpp against transformers on the file's own weights)
within its arithmetic tolerance. A request's thresholds fail the job with
``quality_below_threshold``. A converter fault (rows flipped, a norm offset; the q/k
permutation skipped is the check corpus's), which the quality figures of such a model could not
tell from rounding, fails the exact check: each is a monkeypatch of llama.cpp's converter class for the test's duration, as
in ``tests/integration/real_models/test_checks_fail.py``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from service.errors import QualityBelowThreshold, VerificationFailed
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from tests.fixtures.near_tie import near_tie_llama


def _manifest(tmp_path: Path, export: dict[str, Any], **job: Any) -> dict[str, Any]:
    """The job as the job process runs it; its manifest."""
    source = near_tie_llama()
    config = Settings(data_dir=tmp_path / "data", local_roots=[source.parent])
    job_id = "e" * 32
    layout = JobLayout.for_job(config, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=config, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": [export], **job})
    run_pipeline(spec, ctx, layout)
    manifest: dict[str, Any] = json.loads((layout.artifacts / "manifest.json").read_text())
    return manifest


def _run(tmp_path: Path, export: dict[str, Any]) -> dict[str, Any]:
    """The job's manifest's one export entry."""
    (entry,) = _manifest(tmp_path, export)["exports"]
    return dict(entry)


CODE = """def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
"""


def test_the_requests_verify_text_is_what_every_logit_figure_is_computed_on(
    tmp_path: Path,
) -> None:
    """A short code text (repeated to two chunks): the reference, llama.cpp's KL run and the
    exact check's forward all on it; the manifest names it, and the figures differ from the
    fixed text's."""
    manifest = _manifest(tmp_path / "code", {"format": "gguf", "type": "q8_0"}, verify_text=CODE)
    (entry,) = manifest["exports"]
    quality = entry["verify"]["logits"]
    assert quality["text"].startswith("request's verify_text"), quality
    fixed = _run(tmp_path / "fixed", {"format": "gguf", "type": "q8_0"})
    assert entry["verify"]["exact"]["judged"], entry["verify"]["exact"]
    assert entry["verify"]["logits"]["kl_mean"] != fixed["verify"]["logits"]["kl_mean"]


@pytest.mark.parametrize("gguf_type", ["q8_0", "Q4_K_M"])
def test_a_correct_file_of_a_near_tie_model_succeeds_with_its_quality_in_the_manifest(
    tmp_path: Path, gguf_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if gguf_type == "q8_0":  # every tensor moved unchanged streamed in blocks of 2 rows or less
        from service.exporters.gguf import artifact_weights

        monkeypatch.setattr(artifact_weights, "ROW_BLOCK_BYTES", 2048)
    verify = _run(tmp_path, {"format": "gguf", "type": gguf_type})["verify"]
    quality, exact = verify["logits"], verify["exact"]
    assert quality["margins"]["near_tie_share"] > 0.2, quality  # the model is what it claims
    assert quality["top1"] < 0.95 and quality["kl_mean"] > 0, quality
    if gguf_type == "Q4_K_M":  # below what a correct file of a decisive model shows (0.7)
        assert quality["top1"] < quality["calibrated_on_decisive_models"]["top1"], quality
    assert quality["thresholds"] is None and quality["default"].startswith("decided_top1")
    assert exact["judged"] and exact["kl_mean"] <= exact["tolerance"], exact
    assert exact["transformed_tensors"] == 4, exact  # q and k of 2 layers, inverted by probes


def test_a_requested_threshold_the_file_misses_fails_with_quality_below_threshold(
    tmp_path: Path,
) -> None:
    """...and publishes nothing (the pipeline's handling of every format's
    ``QualityBelowThreshold``; NNEF q4_0's judgement is unit-tested in nnef/test_exact.py)."""
    export = {"format": "gguf", "type": "q8_0", "verify": {"max_kl": 1e-9}}
    with pytest.raises(QualityBelowThreshold, match=r"mean KL .* > 1e-09 \(max_kl\)") as failed:
        _run(tmp_path, export)
    assert failed.value.code == "quality_below_threshold"
    assert not JobLayout.for_job(Settings(data_dir=tmp_path / "data"), "e" * 32).artifacts.exists()


def _converter(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    """llama.cpp's Llama class with ``change(name, tensor)`` applied to what it writes."""
    from service.shims.llama_cpp_convert import load_converter

    load_converter()
    llama = importlib.import_module("conversion.llama").LlamaModel
    modify = llama.modify_tensors

    def changed(self: Any, data: Any, name: str, bid: int | None) -> Any:
        return [(new, change(new, tensor)) for new, tensor in modify(self, data, name, bid)]

    monkeypatch.setattr(llama, "modify_tensors", changed)


MUTATIONS = {
    "rows flipped": lambda name, t: t.flip(0) if name == "blk.1.ffn_down.weight" else t,
    "norm offset": lambda name, t: t + 1.0 if name == "blk.0.attn_norm.weight" else t,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_converter_fault_on_a_near_tie_model_fails_the_exact_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str
) -> None:
    """(The q/k permutation skipped, on near-tie models, is the check corpus's:
    tests/integration/verification/test_check_corpus.py; on SmolLM2's job, test_checks_fail's.)"""
    _converter(monkeypatch, MUTATIONS[mutation])
    with pytest.raises(VerificationFailed, match="q8_0 GGUF is not what was meant to be written"):
        _run(tmp_path, {"format": "gguf", "type": "q8_0"})
