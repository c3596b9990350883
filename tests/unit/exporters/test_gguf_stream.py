"""The GGUF writer's fast path and its output layouts: torch encoders byte-identical to
gguf.quants, "verify": false checking only the layout, a failing disk write surfacing from the
writer thread, and llama.cpp's split files (loaded by llama.cpp itself from the first, merged by
llama-gguf-split into the single file's tensor bytes, checked by the read-back).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from pydantic import ValidationError

from service.checkpoint import open_checkpoint
from service.errors import VerificationFailed
from service.exporters.base import ExportInputs, ExportResult
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf.directory import read_directory
from service.exporters.gguf.llama_check import perplexity
from service.exporters.gguf.plan import GGUFPlan, plan_gguf
from service.exporters.gguf.stream import (
    RowBlockReader,
    VerifyReport,
    verify_gguf,
    write_gguf_files,
)
from service.llama_cpp import llama_cpp_tool
from service.stage import InMemoryContext
from tests.unit.exporters.test_gguf import _ctx
from tests.unit.exporters.test_gguf_quantize import wide_llama  # noqa: F401 (a fixture)


def _plan(root: Path, c: Any) -> GGUFPlan:
    """llama.cpp's converter's plan (computed tensors are evaluated once per plan)."""
    return plan_gguf(root, c.config, c.reader, "f16", pre_tokenizer_fallback="default")


class _NoReader:
    def tensor_infos(self) -> list[Any]:
        return []

    def aliases(self) -> dict[str, str]:
        return {}


def _edge_rows() -> np.ndarray:
    """Rows whose q8_0 blocks hit every rounding case: zeros, exact halves, subnormal scales."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    rows[0, :32] = 0.0  # d == 0: id is 0, not inf
    rows[1, :32] = np.arange(32, dtype=np.float32) / 2 - 8  # x * id lands on .5
    rows[2, :32] = -127.5 / 127
    rows[3] *= np.float32(1e-30)  # the scale rounds to an f16 subnormal (or 0)
    rows[4] *= np.float32(1e4)
    rows[5, :32] = np.float32(1e-45)
    return rows


@pytest.mark.parametrize("type_name", ["f32", "f16", "q8_0"])
def test_torch_encoders_write_the_bytes_gguf_quants_writes(type_name: str) -> None:
    rows = _edge_rows()
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    blocks = RowBlockReader(_NoReader())  # type: ignore[arg-type]
    want = gguf.quants.quantize(rows, qtype).tobytes()
    for slot in (0, 1):  # both output slots, the second reusing nothing of the first
        assert bytes(blocks.encode(rows, int(qtype), type_name, slot)) == want
    # a non-contiguous block (a permuted q/k view) encodes like its contiguous copy
    view = rows[:, ::-1]
    assert (
        bytes(blocks.encode(view, int(qtype), type_name))
        == gguf.quants.quantize(np.ascontiguousarray(view), qtype).tobytes()
    )


def _export(ckpt: Path, out: Path, **spec: Any) -> tuple[ExportResult, InMemoryContext]:
    out.mkdir(parents=True, exist_ok=True)
    ctx = _ctx(out)
    with open_checkpoint(ckpt) as c:
        spec.setdefault("pre_tokenizer_fallback", "default")  # a tokenizer trained here
        result = GGUFExporter().export(GGUFSpec(**spec), ExportInputs(c), out, ctx)
    return result, ctx


def test_verify_false_checks_the_layout_and_reads_nothing_back(
    wide_llama: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    checked, _ = _export(wide_llama, tmp_path / "checked", type="q8_0")
    fast, ctx = _export(wide_llama, tmp_path / "fast", type="q8_0", verify=False)
    assert checked.digests == fast.digests  # same bytes either way
    assert checked.summary["verification"]["read_back"] is True
    assert checked.summary["verification"]["tensors_checked"] == checked.summary["tensors"]
    assert fast.summary["verification"] == {
        "read_back": False, "files": 1, "tensors_checked": 0,
        "max_abs_error": {}, "worst_fraction_of_bound": {},
    }  # fmt: skip
    assert ctx.total == ctx.done  # one pass announced, one pass done


def test_a_failing_write_in_the_writer_thread_fails_the_export_and_leaves_nothing(
    wide_llama: Path,  # noqa: F811
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
        plan = _plan(wide_llama, c)

        def metadata(writer: gguf.GGUFWriter) -> None:
            real_open = writer.open_output_file

            def open_full(path: Path | None = None) -> None:
                real_open(path)
                assert writer.fout is not None
                writer.fout = [Full(f) for f in writer.fout]  # type: ignore[misc]

            writer.open_output_file = open_full  # type: ignore[method-assign]

        with pytest.raises(OSError, match="No space left"):
            write_gguf_files(out / "m.gguf", plan, c.reader, metadata, _ctx(tmp_path))
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
    wide_llama: Path,  # noqa: F811
    tmp_path: Path,
    flip: int,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(wide_llama) as c:
        plan = _plan(wide_llama, c)

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
                    out / "m.gguf", plan, c.reader, metadata, _ctx(tmp_path), check=report
                )
            assert list(out.iterdir()) == []
            return
        write_gguf_files(out / "m.gguf", plan, c.reader, metadata, _ctx(tmp_path), check=report)
        assert report.tensors_checked == len(plan.tensors) and report.files == 1
        assert 0 < report.worst_fraction_of_bound["f16"] <= 1.0
        again = verify_gguf(out / "m.gguf", _plan(wide_llama, c), c.reader, _ctx(tmp_path))
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


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """wide_llama's shapes with 10 layers: its Q4_K_M is ~4 MB, so llama-gguf-split (whose
    unit is the megabyte) has something to split."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.exporters.test_gguf import _randomize, _write_bpe_tokenizer

    out = tmp_path_factory.mktemp("gguf-deep-llama")
    config = LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=10,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _randomize(model, 0)
    model.save_pretrained(str(out))
    _write_bpe_tokenizer(out)
    return out


@pytest.mark.parametrize("type_", ["f16", "Q4_K_M"])
def test_split_files_load_in_llama_cpp_and_merge_to_the_single_file(
    wide_llama: Path,  # noqa: F811
    deep_llama: Path,
    tmp_path: Path,
    type_: str,
) -> None:
    ckpt = deep_llama if type_ == "Q4_K_M" else wide_llama
    # the file's own llama.cpp checks are test_gguf_quantize's; here: the layout
    whole, _ = _export(ckpt, tmp_path / "whole", type=type_, verify=False)
    split, _ = _export(ckpt, tmp_path / "split", type=type_, max_shard_size="1MB", verify=False)
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


def test_split_layout_is_checked_by_the_read_back(
    wide_llama: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    result, _ = _export(wide_llama, out, type="f16", max_shard_size=600_000)
    files = [out / n for n in result.files]
    n = len(files)
    assert n >= 3 and result.files == [
        f"model-f16-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)
    ]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == result.files
    with open_checkpoint(wide_llama) as c:
        plan = _plan(wide_llama, c)
        report = verify_gguf(files, plan, c.reader, _ctx(tmp_path))
        assert report.files == len(files) and report.tensors_checked == len(plan.tensors)
        with pytest.raises(Exception, match="split keys"):
            verify_gguf(files[::-1], plan, c.reader, _ctx(tmp_path), read_back=False)
        with pytest.raises(Exception, match="split.count"):
            verify_gguf(files[0], plan, c.reader, _ctx(tmp_path), read_back=False)


@pytest.mark.parametrize("size", ["0", "-1GB", "ten", 0])
def test_an_unparseable_max_shard_size_is_refused_at_submission(size: object) -> None:
    with pytest.raises(ValidationError):
        GGUFSpec.model_validate({"type": "f16", "max_shard_size": size})
