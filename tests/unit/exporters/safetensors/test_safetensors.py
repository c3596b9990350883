"""The safetensors export loads with transformers and computes what the source computes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from service.checkpoint import open_checkpoint
from service.checkpoint.base import FileRegion, TensorInfo, WeightReader
from service.checkpoint.safetensors import parse_header
from service.config import Settings
from service.errors import CorruptCheckpoint, InvalidRequest, JobCancelled
from service.exporters.base import ExportInputs, ExportResult, registry
from service.exporters.safetensors import SafetensorsExporter, SafetensorsSpec
from service.exporters.safetensors.writer import INDEX_FILE
from service.stage import InMemoryContext, Phase
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import Arch, CheckpointKind, build_tiny_model, copy_tree, sample_inputs

EXPORTER = SafetensorsExporter()


def _ctx(tmp_path: Path) -> InMemoryContext:
    return InMemoryContext(settings=Settings(data_dir=tmp_path / "var"), work_dir=tmp_path / "work")


def _export(src: Path, out: Path, ctx: InMemoryContext, **spec: object) -> ExportResult:
    with open_checkpoint(src) as ckpt:
        return EXPORTER.export(
            SafetensorsSpec.model_validate({"format": "safetensors", **spec}),
            ExportInputs(checkpoint=ckpt),
            out,
            ctx,
        )


def _load(arch: Arch, path: Path) -> PreTrainedModel:
    cls = AutoModelForCausalLM if arch == "llama" else AutoModel
    model: PreTrainedModel = cls.from_pretrained(path, dtype=torch.float32)
    model.train(False)
    return model


def _outputs(arch: Arch, model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        out = model(**sample_inputs(arch))
    result: torch.Tensor = out.logits if arch == "llama" else out.last_hidden_state
    return result


CASES: list[tuple[Arch, CheckpointKind]] = [
    ("llama", "safetensors"),
    ("llama", "safetensors-sharded"),
    ("llama", "bin"),
    ("llama", "bin-sharded"),
    ("bert", "safetensors"),
    ("bert", "bin-sharded"),
]


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_float32_export_loads_and_gives_identical_outputs(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory, arch: Arch, kind: CheckpointKind
) -> None:
    ctx = _ctx(tmp_path)
    result = _export(tiny_checkpoint(arch, kind), tmp_path / "out", ctx)
    assert "model.safetensors" in result.files
    expected = _outputs(arch, build_tiny_model(arch))
    assert torch.equal(_outputs(arch, _load(arch, tmp_path / "out")), expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["safetensors", "bin-sharded"])
def test_half_precision_export_is_close_and_stored_in_that_dtype(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory, dtype: str, kind: CheckpointKind
) -> None:
    out = tmp_path / "out"
    _export(tiny_checkpoint("llama", kind), out, _ctx(tmp_path), dtype=dtype)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable) == {getattr(torch, dtype)}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    expected = _outputs("llama", build_tiny_model("llama"))
    got = _outputs("llama", _load("llama", out))
    assert not torch.equal(got, expected)  # the cast really happened
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_integer_and_bool_tensors_keep_their_dtype(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "w": torch.randn(4, 4),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "q": torch.tensor([-1, 2], dtype=torch.int8),
        "h": torch.randn(3).half(),
    }
    save_file(tensors, src / "model.safetensors")
    out = tmp_path / "out"
    _export(src, out, _ctx(tmp_path), dtype="bfloat16")
    with safe_open(out / "model.safetensors", "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], tensors["ids"])
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], tensors["mask"])
    assert got["q"].dtype == torch.int8 and torch.equal(got["q"], tensors["q"])
    assert got["w"].dtype == got["h"].dtype == torch.bfloat16
    assert torch.equal(got["w"], tensors["w"].bfloat16())


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_small_max_shard_size_gives_shards_within_the_limit_and_a_correct_index(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory, kind: CheckpointKind
) -> None:
    limit = 30_000  # below the 32 KiB matrices: those must sit alone, the rest share shards
    out = tmp_path / "out"
    result = _export(tiny_checkpoint("llama", kind), out, _ctx(tmp_path), max_shard_size="30KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3
    assert not (out / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / INDEX_FILE).read_text())
    stored: dict[str, str] = {}
    total = 0
    for shard in shards:
        header = parse_header(shard)  # strict: the written files are valid safetensors
        assert shard.stat().st_size <= limit or len(header.entries) == 1, shard.name
        if any(e.end - e.begin > limit for e in header.entries):
            assert len(header.entries) == 1, shard.name
        else:
            assert shard.stat().st_size <= limit, shard.name
        for entry in header.entries:
            stored[entry.name] = shard.name
            total += entry.end - entry.begin
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == total
    assert set(result.files) >= {INDEX_FILE, *(s.name for s in shards)}
    expected = _outputs("llama", build_tiny_model("llama"))
    assert torch.equal(_outputs("llama", _load("llama", out)), expected)


@pytest.mark.parametrize("kind", ["bin", "bin-sharded", "safetensors"])
def test_tied_weights_are_stored_once_under_the_name_transformers_keeps(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory, kind: CheckpointKind
) -> None:
    out = tmp_path / "out"
    result = _export(tiny_checkpoint("llama", kind, tied=True), out, _ctx(tmp_path))
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    if kind != "safetensors":
        assert result.summary["tied_not_stored"] == {"lm_head.weight": "model.embed_tokens.weight"}
    model = build_tiny_model("llama", tie_word_embeddings=True)
    assert torch.equal(_outputs("llama", _load("llama", out)), _outputs("llama", model))


def test_aliases_the_model_does_not_tie_are_written_as_copies(
    tmp_path: Path, tiny_checkpoint: TinyCheckpointFactory
) -> None:
    src = copy_tree(tiny_checkpoint("llama", "bin", tied=True), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    _export(src, out, _ctx(tmp_path))
    with safe_open(out / "model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
        )


def test_digests_progress_and_metrics_match_the_files(
    tmp_path: Path, llama_sharded_safetensors_dir: Path
) -> None:
    ctx = _ctx(tmp_path)
    out = tmp_path / "out"
    result = _export(
        llama_sharded_safetensors_dir, out, ctx, dtype="bfloat16", max_shard_size=60_000
    )
    for name in result.files:
        assert result.digests[name] == hashlib.sha256((out / name).read_bytes()).hexdigest(), name
    assert {p.name for p in out.iterdir()} == set(result.files)
    weights = [p for p in out.glob("*.safetensors")]
    written = sum(p.stat().st_size for p in weights)
    assert ctx.phases_seen == [Phase.EXPORT] and ctx.unit == "bytes"
    assert ctx.total == ctx.done == written == ctx.metrics["bytes_written"]
    source_bytes = sum(
        i.nbytes for i in open_checkpoint(llama_sharded_safetensors_dir).reader.tensor_infos()
    )
    assert ctx.metrics["bytes_read"] == source_bytes
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
        result.files
    )
    assert (out / "tokenizer.json").read_bytes() == (
        llama_sharded_safetensors_dir / "tokenizer.json"
    ).read_bytes()


def test_cancellation_stops_the_export(tmp_path: Path, llama_safetensors_dir: Path) -> None:
    ctx = _ctx(tmp_path)
    ctx.cancel_event.set()
    with pytest.raises(JobCancelled):
        _export(llama_safetensors_dir, tmp_path / "out", ctx)


@pytest.mark.parametrize("size", ["5 parsecs", "0", -3, "GB", ""])
def test_invalid_max_shard_size_is_an_invalid_request(tmp_path: Path, size: object) -> None:
    spec = SafetensorsSpec.model_validate({"format": "safetensors", "max_shard_size": size})
    with pytest.raises(InvalidRequest):
        EXPORTER.check(spec, None)


@pytest.mark.parametrize(
    ("text", "expected"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("1GiB", 2**30), (1234, 1234)]
)
def test_max_shard_size_units(text: str | int, expected: int) -> None:
    from service.units import parse_size

    EXPORTER.check(SafetensorsSpec(max_shard_size=text), None)
    assert parse_size(text) == expected


def test_the_exporter_is_registered() -> None:
    import service.exporters  # noqa: F401

    assert isinstance(registry()["safetensors"], SafetensorsExporter)
    assert registry()["safetensors"].spec_type is SafetensorsSpec


def test_prefetch_keeps_order_and_reraises_producer_errors() -> None:
    from service.exporters.safetensors.writer import prefetched

    assert list(prefetched(iter(range(100)), depth=3)) == list(range(100))

    def failing() -> Iterator[int]:
        yield 1
        raise CorruptCheckpoint("shard went away")

    with pytest.raises(CorruptCheckpoint, match="went away"):
        list(prefetched(failing()))


def test_prefetch_stops_the_producer_when_the_consumer_stops() -> None:
    from service.exporters.safetensors.writer import prefetched

    produced: list[int] = []

    def counting() -> Iterator[int]:
        for i in range(1000):
            produced.append(i)
            yield i

    for item in prefetched(counting(), depth=2):
        if item == 5:
            break
    assert len(produced) <= 5 + 2 + 2


def test_cancellation_between_chunks_stops_a_running_export(
    tmp_path: Path, llama_safetensors_dir: Path
) -> None:
    ctx = _ctx(tmp_path)
    calls = 0

    def abort_after_three() -> None:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise JobCancelled("cancelled mid-export")

    ctx.check_abort = abort_after_three  # type: ignore[method-assign]
    with pytest.raises(JobCancelled):
        _export(llama_safetensors_dir, tmp_path / "out", ctx, max_shard_size="30KB")
    assert 0 < ctx.done < (ctx.total or 0)


class _ChunksOnly:
    """A reader offering only the base protocol (no ``read_into``), like third-party readers."""

    def __init__(self, inner: WeightReader) -> None:
        self.inner = inner

    def tensor_infos(self) -> list[TensorInfo]:
        return self.inner.tensor_infos()

    def aliases(self) -> dict[str, str]:
        return self.inner.aliases()

    def read(self, name: str) -> torch.Tensor:
        return self.inner.read(name)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        return self.inner.iter_chunks(name, max_bytes)

    def region(self, name: str) -> FileRegion | None:
        return self.inner.region(name)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("reuse_buffers", [True, False])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_tiny_chunks_cycle_the_buffer_ring_without_corrupting_data(
    tmp_path: Path,
    llama_bin_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    reuse_buffers: bool,
    dtype: str | None,
) -> None:
    import service.exporters.safetensors.writer as st

    monkeypatch.setattr(st, "CHUNK_BYTES", 4096)  # hundreds of chunks through a 4-slot ring
    out = tmp_path / "out"
    with open_checkpoint(llama_bin_dir) as ckpt:
        if not reuse_buffers:
            ckpt.reader = _ChunksOnly(ckpt.reader)
        spec = SafetensorsSpec(dtype=dtype)  # type: ignore[arg-type]
        EXPORTER.export(spec, ExportInputs(checkpoint=ckpt), out, _ctx(tmp_path))
    expected = build_tiny_model("llama").state_dict()
    with safe_open(out / "model.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            want = expected[name] if dtype is None else expected[name].bfloat16()
            assert torch.equal(f.get_tensor(name), want), name


def test_export_restores_torch_thread_count_even_when_cancelled(
    tmp_path: Path, llama_safetensors_dir: Path
) -> None:
    before = torch.get_num_threads()
    ctx = _ctx(tmp_path)
    ctx.cancel_event.set()
    with pytest.raises(JobCancelled):
        _export(llama_safetensors_dir, tmp_path / "out", ctx)
    assert torch.get_num_threads() == before
