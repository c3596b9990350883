"""NNEF export checks that need no tract: the spec, the architectures refused at submission, the
unpickling and remote-code traps (refused before tract would run), the checkpoint tensor, and
what the tract child imports beside it.
What tract loads and runs is tests/integration/exporters/test_nnef.py."""

from __future__ import annotations

import json
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from service.api.errors import http_status
from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import (
    NoModelConfig,
    UnsafePickle,
    UnsupportedExport,
)
from service.exporters.base import ExportInputs, ExportResult, registry
from service.exporters.nnef.exporter import NNEFExporter, NNEFSpec
from service.shims.torch_to_nnef import weights_only_unpickling
from service.stage import InMemoryContext
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import (
    copy_tree,
    write_pickle_with_object,
)


@dataclass
class Exported:
    out: Path
    result: ExportResult
    ctx: InMemoryContext
    system_tmp: Path
    connects: list[Any]


def _export(
    ckpt_dir: Path, root: Path, spec: NNEFSpec, settings: Settings | None = None
) -> Exported:
    """Export with sockets refused and tempfile redirected; record what was attempted."""
    root.mkdir(parents=True, exist_ok=True)
    system_tmp = root / "system-tmp"
    system_tmp.mkdir()
    ctx = InMemoryContext(
        settings=settings or Settings(data_dir=root / "data"), work_dir=root / "work"
    )
    ctx.work_dir.mkdir()
    connects: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        connects.append(address)
        raise OSError("network disabled in this test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(tempfile, "tempdir", str(system_tmp))
        with open_checkpoint(ckpt_dir) as ckpt:
            result = NNEFExporter().export(spec, ExportInputs(checkpoint=ckpt), root / "out", ctx)
    return Exported(root / "out", result, ctx, system_tmp, connects)


# --- traps of torch-to-nnef, refused before tract would run ------------------------------------


def test_bin_holding_an_object_is_refused_not_executed(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = copy_tree(tiny_checkpoint("llama", "bin"), tmp_path / "evil")
    write_pickle_with_object(ckpt / "pytorch_model.bin")
    with pytest.raises(UnsafePickle):
        _export(ckpt, tmp_path / "job", NNEFSpec())
    assert "unpickled arbitrary code" not in capsys.readouterr().out


def test_torch_to_nnef_fallback_unpickling_is_forced_weights_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch_to_nnef.utils import torch_safe_load

    evil = write_pickle_with_object(tmp_path / "pytorch_model.bin")
    with weights_only_unpickling(), pytest.raises(UnsafePickle):
        torch_safe_load(evil)
    assert "unpickled arbitrary code" not in capsys.readouterr().out
    assert torch.load.__module__.startswith("torch")  # restored after the block


def test_remote_code_is_not_run_without_trust_remote_code(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = copy_tree(tiny_checkpoint("llama", "safetensors"), tmp_path / "remote")
    marker = tmp_path / "remote-code-ran"
    (ckpt / "evil_config.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
    )
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "evil"
    config["auto_map"] = {"AutoConfig": "evil_config.EvilConfig"}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert not Settings().trust_remote_code
    with pytest.raises(NoModelConfig, match="trust_remote_code"):
        _export(ckpt, tmp_path / "job", NNEFSpec())
    assert not marker.exists()


# --- spec, checks and registration -------------------------------------------------------------


def test_spec_parses_compression_and_rejects_unknown_values() -> None:
    assert NNEFSpec.model_validate({"format": "nnef", "compression": "q4_0"}).compression == "q4_0"
    with pytest.raises(ValidationError):
        NNEFSpec.model_validate({"format": "nnef", "compression": "q8"})
    with pytest.raises(ValidationError):
        NNEFSpec.model_validate({"format": "nnef", "surprise": 1})


def test_check_refuses_missing_config_and_another_tract_version() -> None:
    exporter = NNEFExporter()
    with pytest.raises(UnsupportedExport):
        exporter.check(NNEFSpec(), None)
    with pytest.raises(UnsupportedExport, match="tract 0.1.0 requested"):
        exporter.check(NNEFSpec(tract_version="0.1.0"), LLAMA_CONFIG)
    exporter.check(NNEFSpec(), LLAMA_CONFIG)


LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize(
    "config,match",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "causal LM type 'gpt2'"),
        ({"model_type": "t5", "architectures": ["T5Model"]}, "model type 't5'"),
        ({"model_type": "llama"}, "model type 'llama'"),  # no causal head named: not an encoder
    ],
)
def test_an_architecture_nnef_is_not_tested_on_is_refused_with_the_list(
    config: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedExport, match=match) as info:
        NNEFExporter().check(NNEFSpec(), config)
    assert "supported: causal LMs cohere, exaone4, falcon, gemma, gemma2, gemma3_text," in str(
        info.value
    )
    assert http_status(info.value) == 422


def test_falcon_with_alibi_is_refused_naming_the_mask_falcon_builds_it_from() -> None:
    falcon = {"model_type": "falcon", "architectures": ["FalconForCausalLM"]}
    NNEFExporter().check(NNEFSpec(), {**falcon, "alibi": False})
    with pytest.raises(UnsupportedExport, match="Falcon with ALiBi") as info:
        NNEFExporter().check(NNEFSpec(), {**falcon, "alibi": True})
    assert "4-D causal mask" in str(info.value) and "2-D padding mask" in str(info.value)
    assert http_status(info.value) == 422


def test_exporter_is_registered_under_nnef() -> None:
    assert isinstance(registry()["nnef"], NNEFExporter)


def test_checkpoint_tensor_rereads_the_checkpoint_casts_lazily_and_keeps_rewrites(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    from service.shims.torch_to_nnef import CheckpointTensor

    reads: list[int] = []
    with open_checkpoint(tiny_checkpoint("llama", "safetensors")) as ckpt:
        name = "model.embed_tokens.weight"
        stored = ckpt.reader.read(name)
        tensor = CheckpointTensor.create(
            ckpt.reader, name, name, tuple(stored.shape), stored.dtype, tmp_path, reads.append
        )
        assert torch.equal(tensor.reload(), stored)
        assert reads == [stored.nbytes]
        assert list(tmp_path.iterdir()) == []  # the checkpoint is the store: no copy
        tensor.to(torch.float16)
        assert tensor.reload().dtype == torch.float16
        assert torch.allclose(tensor.reload().float(), stored, atol=1e-3)
        with weights_only_unpickling():
            tensor.update_values(torch.zeros_like(stored))
            assert tensor.source is None
            assert torch.count_nonzero(tensor.reload()) == 0  # now from its own .pt payload
        assert len(list(tmp_path.iterdir())) == 1


def test_sizing_the_offloaded_model_reads_no_weight(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """The tract budget's block sizes and torch-to-nnef's dtype vote count elements of every
    weight: from the shells, not by reading each weight back (once a full pass per call)."""
    from torch_to_nnef_llm.exporter import LLMExporter

    from service.exporters.common.offloaded_model import offloaded_model
    from service.exporters.nnef.exporter import _block_bytes, _PromptTokenizer
    from service.offload.build import build_on_meta

    reads: list[int] = []
    with open_checkpoint(tiny_checkpoint("llama", "safetensors")) as ckpt:
        built = offloaded_model(
            build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=tmp_path, hook=reads.append
        )
        block = _block_bytes(built)
        vocab = int(built.config.vocab_size)
        exporter = LLMExporter(built.module, _PromptTokenizer([1, 2], "llama", vocab))
        assert exporter.inputs_dtype == torch.float32
        assert reads == []
        assert block is not None and 0 < block < built.weight_bytes


def test_the_tract_child_imports_graph_text_beside_it_and_nothing_it_could_shadow() -> None:
    """The tract child runs by path, its directory first on ``sys.path``, and imports
    ``graph_text`` from there without the ``service`` package: ``graph_text`` imports only the
    standard library, and no module in that directory is named like one the child imports."""
    import ast
    import sys

    from service.exporters.nnef import graph_text

    tree = ast.parse(Path(graph_text.__file__).read_text())
    imported = {
        ((node.module or "") if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    here = Path(graph_text.__file__).parent
    siblings = {p.stem for p in here.glob("*.py")} | {p.name for p in here.iterdir() if p.is_dir()}
    assert siblings & (sys.stdlib_module_names | {"numpy", "tract"}) == set()
