"""Writing a GGUF (``service.exporters.gguf.writer``): block and piece sizes change no byte, a
failing disk write surfaces from the writer thread, each block is read back from the file as it
is written (a byte the disk changes fails the export), and llama.cpp's split files (loaded by
llama.cpp itself from the first, merged by llama-gguf-split into the single file's tensor bytes).
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from service.checkpoint import WeightReader, open_checkpoint
from service.errors import VerificationFailed
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.layout import layout_gguf
from service.exporters.gguf.llama_check import perplexity
from service.exporters.gguf.verify import VerifyReport, verify_gguf
from service.exporters.gguf.writer import write_gguf, write_gguf_files
from service.shims.llama_cpp import llama_cpp_tool
from tests.fixtures.gguf_files import export_gguf, gguf_ctx, layout_of


class OddChunks:
    """The real checkpoint reader, asked for pieces of 7 elements whatever the caller wants:
    the writer must reassemble rows split anywhere, as a reader with its own limits may do."""

    def __init__(self, reader: WeightReader) -> None:
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        return self._reader.iter_chunks(name, 7 * 4)


def test_blocks_of_any_size_produce_the_same_file(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    """Tiny blocks (one head of q/k at a time) and reader pieces split mid-row change nothing."""
    ckpt_dir, _ = llama
    digests = []
    with open_checkpoint(ckpt_dir) as ckpt:
        runs: list[tuple[Any, int]] = [
            (ckpt.reader, 1 << 26),
            (ckpt.reader, 1000),
            (OddChunks(ckpt.reader), 1000),
        ]
        for i, (reader, chunk) in enumerate(runs):
            path = tmp_path / f"run{i}.gguf"
            plan = layout_of(ckpt_dir, "q8_0")  # computed tensors are evaluated once per plan
            digests.append(write_gguf(path, plan, reader, lambda w: None, gguf_ctx(tmp_path), chunk))
            assert digests[-1] == hashlib.sha256(path.read_bytes()).hexdigest()
            verify_gguf(path, layout_of(ckpt_dir, "q8_0"), reader, gguf_ctx(tmp_path), chunk)
    assert digests[0] == digests[1] == digests[2]


def test_a_failing_write_in_the_writer_thread_fails_the_export_and_leaves_nothing(
    wide_llama: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()

    class Full:
        """The file object of a full disk: its writes fail."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def write(self, data: Any) -> int:
            if len(data) > 4096:
                raise OSError(28, "No space left on device")
            return int(self.real.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    with open_checkpoint(wide_llama) as c:
        plan = layout_gguf(wide_llama, c.config, c.reader, "f16", pre_tokenizer_fallback="default")

        def metadata(writer: gguf.GGUFWriter) -> None:
            real_open = writer.open_output_file

            def open_full(path: Path | None = None) -> None:
                real_open(path)
                assert writer.fout is not None
                writer.fout = [Full(f) for f in writer.fout]  # type: ignore[misc]

            writer.open_output_file = open_full  # type: ignore[method-assign]

        with pytest.raises(OSError, match="No space left"):
            write_gguf_files(out / "m.gguf", plan, c.reader, metadata, gguf_ctx(tmp_path))
    assert list(out.iterdir()) == []


class _FlippingDisk:
    """The file object of a disk that changes one byte of the ``nth`` large write: the bytes
    handed to it (and hashed) are right, the file's are not."""

    def __init__(self, real: Any, nth: int) -> None:
        self.real, self.left = real, nth

    def write(self, data: Any) -> int:
        if len(data) > 4096:
            self.left -= 1
            if self.left == 0:
                changed = bytearray(data)
                changed[len(changed) // 2 | 1] ^= 0x40  # an f16's exponent bit
                return int(self.real.write(changed))
        return int(self.real.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.parametrize("flip", [0, 3])
def test_each_block_is_read_back_from_the_file_as_it_is_written(
    wide_llama: Path,
    tmp_path: Path,
    flip: int,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(wide_llama) as c:
        plan = layout_gguf(wide_llama, c.config, c.reader, "f16", pre_tokenizer_fallback="default")

        def metadata(writer: gguf.GGUFWriter) -> None:
            real_open = writer.open_output_file

            def open_flipping(path: Path | None = None) -> None:
                real_open(path)
                assert writer.fout is not None
                writer.fout = [_FlippingDisk(f, flip) for f in writer.fout]  # type: ignore[misc]

            writer.open_output_file = open_flipping  # type: ignore[method-assign]

        report = VerifyReport()
        if flip:
            with pytest.raises(VerificationFailed, match="beyond the f16 tolerance"):
                write_gguf_files(
                    out / "m.gguf", plan, c.reader, metadata, gguf_ctx(tmp_path), check=report
                )
            assert list(out.iterdir()) == []
            return
        write_gguf_files(out / "m.gguf", plan, c.reader, metadata, gguf_ctx(tmp_path), check=report)
        assert report.tensors_checked == len(plan.tensors) and report.files == 1
        assert 0 < report.worst_fraction_of_bound["f16"] <= 1.0
        again = verify_gguf(out / "m.gguf", layout_gguf(wide_llama, c.config, c.reader, "f16", pre_tokenizer_fallback="default"), c.reader, gguf_ctx(tmp_path))
        assert report.as_dict() == again.as_dict()  # the same figures as a read-back after


def _tensor_bytes(files: list[Path]) -> dict[str, bytes]:
    out = {}
    for f in files:
        data = f.read_bytes()
        for t in read_directory(f).tensors:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(t.shape)) // block * size
            out[t.name] = data[t.offset : t.offset + n]
    return out


def _merge(first: Path, dest: Path) -> Path:
    tool = llama_cpp_tool("llama-gguf-split")
    subprocess.run(
        [str(tool), "--merge", str(first), str(dest)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return dest


@pytest.mark.parametrize("type_", ["f16", "Q4_K_M"])
def test_split_files_load_in_llama_cpp_and_merge_to_the_single_file(
    wide_llama: Path,
    deep_llama: Path,
    tmp_path: Path,
    type_: str,
) -> None:
    ckpt = deep_llama if type_ == "Q4_K_M" else wide_llama
    # the file's own llama.cpp checks are test_quantize's and test_llama_check's; here: the layout
    whole, _ = export_gguf(ckpt, tmp_path / "whole", type_, verify=False)
    split, _ = export_gguf(ckpt, tmp_path / "split", type_, max_shard_size="1MB", verify=False)
    names = split.files
    n = len(names)
    assert n >= 3
    assert names == [f"model-{type_}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert set(split.digests) == set(names) and split.summary["files"] == names
    assert sorted(p.name for p in (tmp_path / "split").iterdir() if p.is_file()) == names
    files = [tmp_path / "split" / name for name in names]
    total = sum(len(read_directory(f).tensors) for f in files)
    for i, f in enumerate(files):
        meta = read_directory(f).metadata
        assert (meta["split.no"], meta["split.count"], meta["split.tensors.count"]) == (i, n, total)
    assert "general.architecture" in read_directory(files[0]).metadata

    single = tmp_path / "whole" / whole.files[0]
    assert _tensor_bytes(files) == _tensor_bytes([single])
    merged = _merge(files[0], tmp_path / "merged.gguf")
    assert _tensor_bytes([merged]) == _tensor_bytes([single])
    # llama.cpp loads the split model from its first file and computes what the single one does
    work = tmp_path / "ppl"
    work.mkdir()
    assert perplexity(files[0], work, lambda: None) == pytest.approx(
        perplexity(single, work, lambda: None), rel=1e-6
    )
