"""The ONNX export's weights a block at a time: the external data written with a block of a few
hundred bytes (every weight in many blocks, cast block by block) is byte for byte the default
block's, and the export still verifies in onnxruntime against transformers' model, whose
linear layers and embedding PyTorch's side of the check then runs a block of rows at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.exporters.base import ExportInputs
from service.exporters.onnx import blocks
from service.exporters.onnx.exporter import DATA_NAME, ONNXExporter, ONNXSpec
from service.stage import InMemoryContext
from tests.conftest import TinyCheckpointFactory

TINY_BLOCK = 256
"""Bytes: a block of one row of the tiny Llama's matrices at most (hundreds of blocks each)."""


def _export(ckpt_dir: Path, root: Path, spec: ONNXSpec, *, from_store: bool) -> dict[str, object]:
    """Export ``ckpt_dir`` as the pipeline does (from the job's offload store, every weight on
    disk) or alone (the checkpoint's reader); the manifest's summary."""
    from tests.fixtures.offloaded import export_from_store

    settings = Settings(data_dir=root / "data")
    ctx = InMemoryContext(settings=settings, work_dir=root / "work", job_id="b" * 32)
    ctx.work_dir.mkdir(parents=True)
    if from_store:
        return export_from_store(ONNXExporter(), spec, ckpt_dir, root / "out", settings, ctx).summary
    with open_checkpoint(ckpt_dir) as ckpt:
        return ONNXExporter().export(spec, ExportInputs(checkpoint=ckpt), root / "out", ctx).summary


@pytest.mark.parametrize("from_store", [True, False], ids=["offload-store", "checkpoint-reader"])
def test_external_data_written_in_tiny_blocks_is_the_default_blocks_and_verifies(
    from_store: bool,
    tiny_checkpoint: TinyCheckpointFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = tiny_checkpoint("llama", "safetensors", tied=True)  # float32: float16 is a cast
    spec = ONNXSpec(dtype="float16", decode_steps=2, layout="optimum")
    _export(ckpt, tmp_path / "default", spec.model_copy(update={"verify": False}),
            from_store=from_store)  # fmt: skip
    written: list[int] = []
    real = blocks.weight_blocks

    def counted(source: object, target: object, block_bytes: int) -> object:
        found = real(source, target, block_bytes)  # type: ignore[arg-type]
        if found is None:
            return None
        return (written.append(b.nbytes) or b for b in found)

    monkeypatch.setattr(blocks, "WRITE_BLOCK_BYTES", TINY_BLOCK)
    monkeypatch.setattr(blocks, "weight_blocks", counted)
    summary = _export(ckpt, tmp_path / "tiny", spec, from_store=from_store)
    default = (tmp_path / "default" / "out" / DATA_NAME).read_bytes()
    assert (tmp_path / "tiny" / "out" / DATA_NAME).read_bytes() == default
    assert len(written) > 100 and max(written) <= TINY_BLOCK  # float16 blocks of float32 reads
    verify = summary["verify"]
    assert isinstance(verify, dict)
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"]), verify
