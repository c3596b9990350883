"""NNEF export with every weight read in blocks (``MODELPREP_NNEF_BLOCK_BYTES`` below the tiny
models' matrices): the archive's weights are the bytes of an export that reads each weight
whole, and tract still decodes like PyTorch. torch-to-nnef's own graph text is not compared: it
differs from one run to the next by itself (the export date, the order and numbering of its
fragments and constants)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.exporters.base import ExportInputs
from service.exporters.nnef import NNEFExporter, NNEFSpec
from service.offload.build import build_on_meta
from service.stage import InMemoryContext
from tests.conftest import TinyCheckpointFactory
from tests.unit.exporters.nnef.test_nnef import _export

TINY_BLOCK = "1KiB"
"""Below every matrix of the tiny Llama (its embedding: 256 x 64 float32, 64 KiB), so each is
written, embedded and multiplied in blocks; its norms (256 bytes) keep the whole path."""


def _weights(archive: Path) -> dict[str, bytes]:
    """The archive's weight files (the model's variables, by their tensor names)."""
    with tarfile.open(archive) as tar:
        return {
            m.name: f.read()
            for m in tar.getmembers()
            if m.name.startswith("model.") and (f := tar.extractfile(m)) is not None
        }


@pytest.mark.parametrize("tied", [False, True])
def test_weights_read_in_blocks_give_the_same_archive_weights_and_tract_agrees(
    tied: bool, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint("llama", "safetensors", tied=tied)
    torch.manual_seed(0)  # torch-to-nnef draws the example bundle's past caches at random
    whole = _export(ckpt, tmp_path / "whole", NNEFSpec(decode_steps=2))
    settings = Settings(data_dir=tmp_path / "data", nnef_block_bytes=TINY_BLOCK)
    torch.manual_seed(0)
    blocks = _export(ckpt, tmp_path / "blocks", NNEFSpec(decode_steps=2), settings)
    expected = _weights(whole.out / "model.nnef.tgz")
    got = _weights(blocks.out / "model.nnef.tgz")
    assert sorted(got) == sorted(expected)
    assert len(got) >= 10
    for name, payload in expected.items():
        assert got[name] == payload, f"{name} differs from the whole-tensor write"
    verify = blocks.result.summary["verify"]
    assert verify["max_abs_err"] < 1e-4 and all(verify["argmax_agreed"])
    # PyTorch's outputs in the bundle, the embedding and the head computed a block at a time
    for bundle in ("example_inputs.npz", "example_outputs.npz"):
        with np.load(whole.out / bundle) as a, np.load(blocks.out / bundle) as b:
            assert a.files == b.files
            for name in a.files:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_an_encoder_with_its_weights_read_in_blocks_gives_the_same_weights_and_tract_agrees(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """BERT through torch-to-nnef's traced path: its word embedding is the input embedding
    (zeros in the trace), its position and token-type embeddings, indexed by constants, keep
    their values in the trace."""
    ckpt = tiny_checkpoint("bert", "safetensors")
    whole = _export(ckpt, tmp_path / "whole", NNEFSpec())
    settings = Settings(data_dir=tmp_path / "data", nnef_block_bytes="256B")
    blocks = _export(ckpt, tmp_path / "blocks", NNEFSpec(), settings)
    assert _weights(blocks.out / "model.nnef.tgz") == _weights(whole.out / "model.nnef.tgz")
    assert blocks.result.summary["verify"]["max_abs_err"] < 1e-4
    with (
        np.load(whole.out / "example_outputs.npz") as a,
        np.load(blocks.out / "example_outputs.npz") as b,
    ):
        for name in a.files:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_weights_read_in_blocks_from_the_jobs_offload_store_raw_and_packed(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """The pipeline's path: the export reads the store; a raw entry in pieces of its bytes, a
    packed one (q8_0, as a job's store may hold a weight) in blocks of rows dequantized, and
    the archive holds the values the store gives back whole."""
    from service.offload.store import open_job_store
    from service.shims.torch_to_nnef import nnef_dat_header

    settings = Settings(data_dir=tmp_path / "data", nnef_block_bytes=TINY_BLOCK)
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path / "work", job_id="f" * 32)
    ctx.work_dir.mkdir()
    packed = "model.layers.0.mlp.down_proj.weight"
    with open_checkpoint(tiny_checkpoint("llama", "safetensors")) as ckpt:
        built = build_on_meta(ckpt, settings)
        store = open_job_store(settings, ctx.job_id, ckpt.root)
        for info in ckpt.reader.tensor_infos():
            value = ckpt.reader.read(info.name)
            if info.name == packed:
                store.put_quantized(info.name, value, "q8_0")
            else:
                store.put_tensor(info.name, value)
        store.commit()
        expected = {n: store.load(n).float() for n in (packed, "model.embed_tokens.weight")}
        inputs = ExportInputs(checkpoint=ckpt, skeleton=built.model, store=store)
        result = NNEFExporter().export(NNEFSpec(decode_steps=1), inputs, tmp_path / "out", ctx)
        store.close()
    assert result.summary["verify"]["max_abs_err"] < 1e-4
    weights = _weights(tmp_path / "out" / "model.nnef.tgz")
    for name, value in expected.items():
        header = nnef_dat_header(tuple(value.shape), torch.float32)
        assert weights[f"model.{name}.dat"] == header + value.numpy().tobytes(), name
