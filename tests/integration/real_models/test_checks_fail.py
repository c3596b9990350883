"""The job's own checks can fail: a stage corrupted on purpose must fail the job, in every format
it touches, with no artifact published.

* The reader drops the FP8 scales (its weights become the raw codes, max |w| 448): caught by the
  job's independent reference, transformers' own ``from_pretrained`` of the source, which the
  job's model must match before any artifact is judged (``model.reference`` in the manifest);
  GGUF, whose writer reads the checkpoint rather than the job's model, by llama.cpp's logits
  against that same reference.
* The GGUF writer flips a tensor's rows: caught by the read-back of the written file.
* The GGUF converter skips the q/k permutation llama.cpp's Llama needs: the read-back undoes
  the same (missing) permutation and passes; llama.cpp's logits against transformers' on the
  fixed text (``gguf.llama_check.check_logits``) catch it.
* The safetensors, ONNX and NNEF writers each flip the rows of one weight as they write it
  (``model.layers.0.mlp.down_proj.weight``): the reloaded safetensors' outputs, onnxruntime's
  and tract's against the job's reference catch it.
* Not covered: a converter mutation for safetensors, ONNX and NNEF. None of them permutes a
  weight (safetensors copies the state dict, ONNX and NNEF trace the module and keep PyTorch's
  layout), so GGUF's q/k permutation has no counterpart; a skipped transpose in a graph
  translator changes shapes, which the runtime refuses outright.

How each stage is corrupted: the job runs in this test's process (``run_pipeline``, as the job
process runs it), and ``monkeypatch`` replaces the one function of the stage for the test's
duration; no test hook exists in the service's code. Each replacement wraps the real function
and changes only the one tensor named (GGUF's converter: the one permutation).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.config import Settings
from service.errors import VerificationFailed
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from tests.fixtures.quantized import real_fp8
from tests.fixtures.real_models import Variant, real_variant

LAYERS = 2
EXPORTS: dict[str, dict[str, Any]] = {
    "safetensors": {"format": "safetensors"},
    "nnef": {"format": "nnef", "decode_steps": 3},
    "onnx": {"format": "onnx", "decode_steps": 3},
    "gguf": {"format": "gguf", "type": "q8_0"},
}


CAUGHT_BY = {
    **dict.fromkeys(["safetensors", "nnef", "onnx"], "disagrees with transformers' from_pretrained"),
    # GGUF's writer reads the checkpoint itself, not the job's model: llama.cpp's logits on the
    # fixed text against transformers' run of the source catch the misread weights.
    "gguf": "too far from transformers",
}
"""Which of the job's checks catches a reader that drops the FP8 scales, by format."""


def _run(tmp_path: Path, source: Path, export: dict[str, Any]) -> JobLayout:
    settings = Settings(data_dir=tmp_path / "data", local_roots=[source.parent])
    job_id = "f" * 32
    layout = JobLayout.for_job(settings, job_id)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id=job_id)
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": [export]})
    run_pipeline(spec, ctx, layout)
    return layout


def _raw_codes(codes: torch.Tensor, scale_inv: torch.Tensor, first_row: int,
               rows_per_matrix: int, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The broken reader: FP8 codes cast to the model's dtype, their scales ignored."""
    return codes.to(dtype)


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_a_reader_that_drops_the_fp8_scales_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    monkeypatch.setattr("service.checkpoint.fp8.dequantize_rows", _raw_codes)
    with pytest.raises(VerificationFailed, match=CAUGHT_BY[fmt]):
        _run(tmp_path, real_fp8("smollm2", LAYERS), EXPORTS[fmt])
    layout = JobLayout.for_job(Settings(data_dir=tmp_path / "data"), "f" * 32)
    assert not layout.artifacts.exists()


def test_a_gguf_writer_that_flips_a_tensors_rows_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.exporters.gguf import stream

    blocks = stream.RowBlockReader.blocks

    def flipped(self: Any, t: Any, permuted: bool = True) -> Any:
        for block in blocks(self, t, permuted):
            yield block[::-1].copy() if permuted and t.name == "blk.0.ffn_down.weight" else block

    monkeypatch.setattr(stream.RowBlockReader, "blocks", flipped)
    with pytest.raises(VerificationFailed, match="blk.0.ffn_down.weight"):
        _run(tmp_path, real_variant("smollm2", Variant(layers=LAYERS)), {"format": "gguf", "type": "f16"})


def test_a_gguf_converter_that_skips_the_qk_permutation_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    from service.adapters.llama_cpp_convert import load_converter

    load_converter()  # llama.cpp's conversion package, where LlamaModel.permute lives
    llama = importlib.import_module("conversion.llama")
    monkeypatch.setattr(
        llama.LlamaModel, "permute", staticmethod(lambda weights, n_head, n_head_kv=None: weights)
    )
    with pytest.raises(VerificationFailed, match="too far from transformers"):
        _run(tmp_path, real_variant("smollm2", Variant(layers=LAYERS)), {"format": "gguf", "type": "f16"})


FLIPPED = "model.layers.0.mlp.down_proj.weight"
"""The weight the broken writers write upside down."""


def _assert_failed_without_artifacts(tmp_path: Path, source: Path, export: dict[str, Any],
                                     match: str) -> None:  # fmt: skip
    with pytest.raises(VerificationFailed, match=match) as failed:
        _run(tmp_path, source, export)
    assert failed.value.code == "verification_failed"
    layout = JobLayout.for_job(Settings(data_dir=tmp_path / "data"), "f" * 32)
    assert not layout.artifacts.exists()


def test_a_safetensors_writer_that_flips_a_tensors_rows_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.exporters.safetensors import writer

    chunks = writer._shard_chunks

    def flipped(reader: Any, shard: Any, chunk_bytes: int) -> Any:
        tensors, current, left = iter(shard.tensors), None, 0
        for piece, source_bytes in chunks(reader, shard, chunk_bytes):
            if left == 0:
                current = next(tensors)
                left = current.nbytes
            left -= piece.numel() * piece.element_size()
            if current is not None and current.name == FLIPPED:
                assert piece.numel() == math.prod(current.shape)  # one piece: the whole weight
                piece = piece.view(current.shape).flip(0).reshape(-1)
            yield piece, source_bytes

    monkeypatch.setattr(writer, "_shard_chunks", flipped)
    _assert_failed_without_artifacts(
        tmp_path, real_variant("smollm2", Variant(layers=LAYERS)), {"format": "safetensors"},
        "differ|disagree|tolerance",
    )  # fmt: skip


def test_an_onnx_writer_that_flips_a_tensors_rows_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnx_ir as ir

    from service.exporters.onnx import exporter

    attach = exporter.attach_weights

    def flipped(model: Any, weights: Any) -> None:
        attach(model, weights)
        value = model.graph.initializers[FLIPPED]
        rows = value.const_value.numpy()[::-1].copy()
        value.const_value = ir.Tensor(rows, dtype=value.dtype, name=FLIPPED)

    monkeypatch.setattr(exporter, "attach_weights", flipped)
    _assert_failed_without_artifacts(
        tmp_path, real_variant("smollm2", Variant(layers=LAYERS)),
        {"format": "onnx", "decode_steps": 3}, "onnxruntime",
    )  # fmt: skip


def test_an_nnef_writer_that_flips_a_tensors_rows_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_to_nnef.nnef_io import writer

    write = writer.write_nnef_tensor
    flipped_files: list[str] = []

    def flipped(array: Any, filename: str, quantized: bool) -> None:
        if Path(filename).name.endswith(f"{FLIPPED}.dat"):  # model.model.layers.0....dat
            flipped_files.append(filename)
            array = np.ascontiguousarray(array[::-1])
        write(array, filename, quantized)

    monkeypatch.setattr(writer, "write_nnef_tensor", flipped)
    _assert_failed_without_artifacts(
        tmp_path, real_variant("smollm2", Variant(layers=LAYERS)),
        {"format": "nnef", "decode_steps": 3}, "tract",
    )  # fmt: skip
    assert len(flipped_files) == 1, flipped_files  # the mutation did reach the writer
