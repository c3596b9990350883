"""NNEF export for tract: tiny real Llama/BERT checkpoints exported, loaded by tract, compared.

Every export runs with sockets refused and ``tempfile`` pointed at a private directory, so the
"no network" and "no leftover mkdtemp" promises are checked on the real code path.
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import (
    JobCancelled,
    VerificationFailed,
    VerificationTooLarge,
)
from service.exporters.base import ExportInputs
from service.exporters.common.offloaded_model import offloaded_model
from service.exporters.nnef import NNEFExporter, NNEFSpec
from service.exporters.nnef.tract_cli import write_launcher
from service.exporters.nnef.verify import IOSpec, verify_causal_lm
from service.offload.build import build_on_meta
from service.shims.torch_to_nnef import weights_only_unpickling
from service.stage import InMemoryContext, Phase
from service.verification.reference import greedy_reference, prompt_ids
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.families import FamilyVariant, family_checkpoint
from tests.fixtures.models import (
    build_checkpoint,
    build_tiny_llama,
    save_checkpoint,
    save_tiny_family,
    tiny_bert_config,
)
from tests.unit.exporters.nnef.test_nnef import Exported, _export


@pytest.fixture(scope="module")
def llama_export(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> Exported:
    root = tmp_path_factory.mktemp("nnef-llama")
    return _export(tiny_checkpoint("llama", "safetensors"), root, NNEFSpec(decode_steps=3))


def _reference(ckpt_dir: Path, tmp: Path, steps: int = 3) -> Any:
    """PyTorch's greedy decode of the checkpoint (weights streamed, as in the exporter)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with open_checkpoint(ckpt_dir) as ckpt:
        built = offloaded_model(build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=tmp)
        vocab = int(built.config.vocab_size)
        with weights_only_unpickling():
            return greedy_reference(built.module, prompt_ids(4, vocab), steps, record_layers=True)


def scale_weight(archive: Path, dest: Path, member: str, factor: float = -50.0) -> None:
    """Copy ``archive`` with the NNEF tensor file ``member`` multiplied by ``factor`` (float16 or
    float32: the header's bits-per-item is at byte 44, the data after 128 bytes)."""
    with tarfile.open(archive) as src:
        payloads = {m.name: f.read() for m in src.getmembers() if (f := src.extractfile(m))}
    raw = bytearray(payloads[member])
    dtype = {16: np.float16, 32: np.float32}[int.from_bytes(raw[44:48], "little")]
    data = np.frombuffer(bytes(raw[128:]), dtype=dtype)
    raw[128:] = (data * dtype(factor)).astype(dtype).tobytes()
    payloads[member] = bytes(raw)
    with tarfile.open(dest, "w:gz", compresslevel=0) as out:
        for name, payload in payloads.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            out.addfile(info, io.BytesIO(payload))


def _io(out: Path) -> IOSpec:
    return IOSpec.from_json(json.loads((out / "io.json").read_text()))


def _tamper(archive: Path, dest: Path) -> str:
    """Copy ``archive`` with the largest weight negated; returns the member changed."""
    with tarfile.open(archive) as src:
        members = [(m, src.extractfile(m)) for m in src.getmembers()]
        payloads = {m.name: f.read() for m, f in members if f is not None}
    victim = max((n for n in payloads if n.endswith(".dat")), key=lambda n: len(payloads[n]))
    raw = bytearray(payloads[victim])
    data = np.frombuffer(bytes(raw[128:]), dtype=np.float32)
    raw[128:] = (-data).tobytes()
    payloads[victim] = bytes(raw)
    with tarfile.open(dest, "w:gz", compresslevel=0) as out:
        for name, payload in payloads.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            out.addfile(info, io.BytesIO(payload))
    return victim


# --- causal LM --------------------------------------------------------------------------------


def test_llama_archive_runs_in_tract_and_matches_pytorch_over_greedy_decode(
    llama_export: Exported,
) -> None:
    verify = llama_export.result.summary["verify"]
    assert verify["compared"] == 4  # prompt + 3 decode steps through tract's KV cache
    assert verify["max_abs_err"] < 1e-4
    assert all(verify["argmax_agreed"])
    assert llama_export.result.summary["kind"] == "causal_lm"
    for name in llama_export.result.files:
        assert (llama_export.out / name).is_file(), name
    assert {"model.nnef.tgz", "io.json", "config.json", "tokenizer.json"} <= set(
        llama_export.result.files
    )
    assert llama_export.ctx.phases_seen == [Phase.EXPORT, Phase.VERIFY]
    assert llama_export.ctx.metrics["nnef_bytes_read"] > 0


def test_tract_runs_in_a_child_whose_peak_memory_is_reported(llama_export: Exported) -> None:
    import resource

    verify = llama_export.result.summary["verify"]
    # tract holds the whole archive: measured in its own process, reported in the manifest.
    assert verify["tract_peak_rss_bytes"] > llama_export.result.summary["archive_bytes"]
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert children >= verify["tract_peak_rss_bytes"]


def test_verification_tract_cannot_hold_fails_before_exporting(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", tract_max_memory="10MB")
    with pytest.raises(VerificationTooLarge, match="MODELPREP_TRACT_MAX_MEMORY"):
        _export(tiny_checkpoint("llama", "safetensors"), tmp_path, NNEFSpec(), settings)
    assert not (tmp_path / "out" / "model.nnef.tgz").exists()
    assert list((tmp_path / "work").iterdir()) == []
    # Without verification the same budget does not matter.
    exported = _export(
        tiny_checkpoint("llama", "safetensors"), tmp_path / "unverified",
        NNEFSpec(verify=False), settings,
    )  # fmt: skip
    assert exported.result.summary["verify"] is None


def test_export_reads_weights_from_the_jobs_offload_store(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """The pipeline's path: one meta build, dispatched to one store; the export copies the
    build and reads what the store holds from the store."""
    from service.jobs.pipeline import ALL_ON_DISK
    from service.offload.dispatch import dispatch_model
    from service.offload.store import open_job_store

    settings = Settings(data_dir=tmp_path / "data")
    ctx = InMemoryContext(settings=settings, work_dir=tmp_path / "work", job_id="e" * 32)
    ctx.work_dir.mkdir()
    with open_checkpoint(tiny_checkpoint("llama", "bin")) as ckpt:
        built = build_on_meta(ckpt, settings)
        skeleton = copy.deepcopy(built.model)
        store = open_job_store(settings, ctx.job_id, ckpt.root)
        dispatch_model(built, ckpt.reader, store, ctx, max_memory=ALL_ON_DISK)
        before = store.metrics()["bytes_read"]
        inputs = ExportInputs(checkpoint=ckpt, model=built.model, skeleton=skeleton, store=store)
        result = NNEFExporter().export(NNEFSpec(decode_steps=1), inputs, tmp_path / "out", ctx)
        read = store.metrics()["bytes_read"] - before
        store.close()
    assert result.summary["verify"]["max_abs_err"] < 1e-4
    assert read >= result.summary["weight_bytes"]  # every weight came through the store
    assert all(p.is_meta for p in skeleton.parameters())  # the export worked on its own copy


def test_llama_io_spec_names_symbolic_prompt_and_past_axes(llama_export: Exported) -> None:
    io_spec = _io(llama_export.out)
    assert io_spec.kind == "causal_lm"
    assert io_spec.inputs[0].name == "input_ids"
    assert io_spec.inputs[0].shape == [1, "S"]
    caches = io_spec.inputs[1:]
    assert len(caches) == 4  # 2 layers x (key, value)
    assert all(c.shape[2] == "P" and c.dtype == "float32" for c in caches)
    assert io_spec.outputs[0].shape[-1] == 128  # vocab


def test_export_makes_no_network_call_and_leaves_no_temp_dirs(llama_export: Exported) -> None:
    assert llama_export.connects == []
    assert list(llama_export.system_tmp.iterdir()) == []
    assert list(llama_export.ctx.work_dir.iterdir()) == []


def _graph_text(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("graph.nnef")
        assert member is not None
        return member.read().decode()


def test_archive_properties_carry_no_host_command_line(llama_export: Exported) -> None:
    graph = _graph_text(llama_export.out / "model.nnef.tgz")
    assert "export_cmd" in graph and '"modelprep"' in graph
    assert sys.argv[0] not in graph and str(llama_export.ctx.work_dir.parent) not in graph


def test_tampered_archive_fails_verification(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    expected = _reference(tiny_checkpoint("llama", "safetensors"), tmp_path / "off")
    io_spec = _io(llama_export.out)
    archive = llama_export.out / "model.nnef.tgz"
    # The untouched archive passes this very check ...
    verify_causal_lm(archive, io_spec, expected, atol=1e-3, rtol=1e-3, work=tmp_path / "v")
    # ... and the same archive with one weight negated does not.
    bad = tmp_path / "tampered.nnef.tgz"
    _tamper(archive, bad)
    with pytest.raises(VerificationFailed, match="tract logits differ"):
        verify_causal_lm(bad, io_spec, expected, atol=1e-3, rtol=1e-3, work=tmp_path / "v")


def test_one_tract_child_gives_the_decode_and_the_fixed_text_checks(
    llama_export: Exported,
    tiny_checkpoint: TinyCheckpointFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tract loads the archive once for both checks of a whole archive (the load is most of
    either): the fixed text's figures judged from that child are those of its own child."""
    import transformers

    from service.exporters.nnef import verify as ver
    from service.verification.independent import independent_reference
    from service.verification.logits import FIXED_TEXT
    from service.verification.reference import fixed_input_ids

    ckpt = tiny_checkpoint("llama", "safetensors")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    independent = independent_reference(
        ckpt, transformers.LlamaForCausalLM, fixed_input_ids(vocab), FIXED_TEXT, 1 << 34,
        tmp_path / "reference",
    )  # fmt: skip
    assert independent.chunks is not None
    expected = _reference(ckpt, tmp_path / "off")
    io_spec, archive = _io(llama_export.out), llama_export.out / "model.nnef.tgz"
    commands: list[str] = []
    run_tract = ver.run_tract

    def counted(archive: Path, command: str, *args: Any, **kwargs: Any) -> Any:
        commands.append(command)
        return run_tract(archive, command, *args, **kwargs)

    monkeypatch.setattr(ver, "run_tract", counted)
    text = ver.TextCheck("float32", None, independent)
    report = ver.verify_causal_lm(
        archive, io_spec, expected, 1e-3, 1e-3, work=tmp_path / "both", text=text
    )
    assert commands == ["decode"]
    alone = ver.check_logits(archive, io_spec, "float32", None, independent, work=tmp_path / "l")
    assert commands == ["decode", "logits"]
    both = report.extra["logits"]
    assert both["scored_by"] == alone["scored_by"] == "steps"
    assert both["mode"] == alone["mode"] == "whole"
    assert both["positions"] == alone["positions"] > 0
    assert both["kl_mean"] == pytest.approx(alone["kl_mean"], abs=1e-9)
    assert both["top1"] == alone["top1"]
    # the decode is still judged first: a negated weight fails it, not the text's bounds
    bad = tmp_path / "tampered.nnef.tgz"
    _tamper(archive, bad)
    with pytest.raises(VerificationFailed, match="tract logits differ"):
        ver.verify_causal_lm(bad, io_spec, expected, 1e-3, 1e-3, work=tmp_path / "v", text=text)


def test_head_copied_onto_every_position_only_where_the_graph_slices_the_last_one() -> None:
    """The copy follows every statement after the slice that reads it (Gemma's soft-capping
    too), leaves the shipped statements and outputs as they were, and gives up (None) on a
    graph without that one slice."""
    from service.exporters.nnef.graph_text import head_over_every_position

    graph = (
        "version 1.0;\n\ngraph network(ids, c) -> (outputs, c_out)\n{\n"
        "    h = f(ids);\n    c_out = g(c);\n"
        "    s = dyn_slice_begin(h, axis = 1, begin = -1, stride = 1);\n"
        "    w = variable<scalar>(label = 'w', shape = [4, 2]);\n"
        "    l = linear(s, w, 0.0);\n    d = div(l, 30.0);\n    outputs = mul(tanh(d), 30.0);\n}\n"
    )
    edited = head_over_every_position(graph)
    assert edited is not None
    assert edited.startswith(graph[: graph.index("graph network")])
    assert "-> (outputs, c_out, outputs__every_position)" in edited
    for line in graph.splitlines()[4:-1]:
        assert line in edited.splitlines()
    assert "    l__every_position = linear(h, w, 0.0);" in edited
    assert "    d__every_position = div(l__every_position, 30.0);" in edited
    assert "    outputs__every_position = mul(tanh(d__every_position), 30.0);" in edited
    assert "w__every_position" not in edited
    assert head_over_every_position(graph.replace("begin = -1", "begin = 0")) is None


def test_a_weight_broken_in_one_layer_fails_naming_that_layer(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    expected = _reference(tiny_checkpoint("llama", "safetensors"), tmp_path / "off")
    assert expected.layer_names == ["model.layers.0", "model.layers.1"]
    bad = tmp_path / "layer1.nnef.tgz"
    scale_weight(
        llama_export.out / "model.nnef.tgz", bad, "model.model.layers.1.mlp.down_proj.weight.dat"
    )
    with pytest.raises(VerificationFailed, match=r"tract logits differ .*; first diverges at "
                       r"model\.layers\.1 on the prompt \(max abs diff"):  # fmt: skip
        verify_causal_lm(bad, _io(llama_export.out), expected, 1e-3, 1e-3, work=tmp_path / "v")


def test_a_head_broken_after_every_layer_says_the_layers_agree(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    expected = _reference(tiny_checkpoint("llama", "safetensors"), tmp_path / "off")
    bad = tmp_path / "head.nnef.tgz"
    scale_weight(llama_export.out / "model.nnef.tgz", bad, "model.lm_head.weight.dat")
    with pytest.raises(VerificationFailed, match=r"every layer's output agrees \(2 layers\)"):
        verify_causal_lm(bad, _io(llama_export.out), expected, 1e-3, 1e-3, work=tmp_path / "v")


def test_archive_compared_with_a_different_model_fails_verification(
    llama_export: Exported, tmp_path: Path
) -> None:
    other = build_checkpoint(tmp_path / "other", "llama", "safetensors", seed=7)
    expected = _reference(other, tmp_path / "off")
    with pytest.raises(VerificationFailed):
        verify_causal_lm(
            llama_export.out / "model.nnef.tgz",
            _io(llama_export.out),
            expected,
            atol=1e-3,
            rtol=1e-3,
            work=tmp_path / "v",
        )


def test_q4_0_archive_is_smaller_and_matches_quantized_pytorch(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    exported = _export(
        tiny_checkpoint("llama", "safetensors"), tmp_path, NNEFSpec(compression="q4_0")
    )
    verify = exported.result.summary["verify"]
    assert verify["max_abs_err"] < 1e-3
    assert exported.result.summary["compression"] == "q4_0"
    f32_bytes = llama_export.result.summary["archive_bytes"]
    assert exported.result.summary["archive_bytes"] < 0.6 * f32_bytes
    with tarfile.open(exported.out / "model.nnef.tgz") as tar:
        sizes = {m.name: m.size for m in tar.getmembers()}
    lm_head = next(size for name, size in sizes.items() if "lm_head" in name)
    assert lm_head < 128 * 64 * 4 / 4  # 4.5 bits per weight instead of 32
    assert exported.connects == []
    assert list(exported.system_tmp.iterdir()) == []
    assert _io(exported.out).compression == "q4_0"


def test_bin_checkpoint_exports_through_the_weights_only_reader(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    exported = _export(tiny_checkpoint("llama", "bin"), tmp_path, NNEFSpec(decode_steps=1))
    assert exported.result.summary["verify"]["max_abs_err"] < 1e-4


def test_tied_embeddings_stored_once_export_and_match(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint("llama", "safetensors", tied=True)
    with open_checkpoint(ckpt) as opened:
        assert "lm_head.weight" not in {i.name for i in opened.reader.tensor_infos()}
    exported = _export(ckpt, tmp_path, NNEFSpec(decode_steps=1))
    assert exported.result.summary["verify"]["max_abs_err"] < 1e-4


def test_float16_llama_keeps_float16_caches_and_matches(tmp_path: Path) -> None:
    model = build_tiny_llama()
    torch.nn.Module.to(model, torch.float16)
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    exported = _export(ckpt, tmp_path / "job", NNEFSpec(decode_steps=1))
    assert exported.result.summary["dtype"] == "float16"
    assert exported.result.summary["verify"]["max_abs_err"] < 1e-3
    assert {t.dtype for t in _io(exported.out).inputs[1:]} == {"float16"}


def test_encoder_with_a_head_exports_the_checkpoint_architecture(tmp_path: Path) -> None:
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    ckpt = save_checkpoint(BertForMaskedLM(tiny_bert_config()), tmp_path / "ckpt")
    exported = _export(ckpt, tmp_path / "job", NNEFSpec())
    assert [t.name for t in _io(exported.out).outputs] == ["logits"]
    assert exported.result.summary["verify"]["max_abs_err"] < 1e-4


# --- traps of torch-to-nnef -------------------------------------------------------------------


def test_cancelled_job_stops_at_the_next_weight_read_and_cleans_up(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    ctx = InMemoryContext(settings=Settings(data_dir=tmp_path / "d"), work_dir=tmp_path / "w")
    ctx.work_dir.mkdir()
    ctx.cancel_event.set()
    with (
        open_checkpoint(tiny_checkpoint("llama", "safetensors")) as ckpt,
        pytest.raises(JobCancelled),
    ):
        NNEFExporter().export(NNEFSpec(), ExportInputs(checkpoint=ckpt), tmp_path / "o", ctx)
    assert list(ctx.work_dir.iterdir()) == []


# --- encoder ----------------------------------------------------------------------------------


def test_bert_encoder_archive_matches_pytorch(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    exported = _export(tiny_checkpoint("bert", "safetensors"), tmp_path, NNEFSpec())
    summary = exported.result.summary
    assert summary["kind"] == "encoder"
    assert summary["verify"]["max_abs_err"] < 1e-4
    assert summary["verify"]["compared"] == 2
    io_spec = _io(exported.out)
    assert [t.name for t in io_spec.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [t.name for t in io_spec.outputs] == ["last_hidden_state", "pooler_output"]
    assert io_spec.inputs[0].shape == [1, "S"]
    assert exported.connects == []
    graph = _graph_text(exported.out / "model.nnef.tgz")
    assert '"modelprep"' in graph and sys.argv[0] not in graph


# --- tract CLI shim ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tract_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_launcher(tmp_path_factory.mktemp("bin"))


def test_tract_cli_reports_the_bindings_version(tract_launcher: Path) -> None:
    import tract

    out = subprocess.run([tract_launcher, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tract {tract.version()}"


def test_tract_cli_asserts_output_bundles_as_torch_to_nnef_invokes_it(
    tract_launcher: Path, llama_export: Exported, tmp_path: Path
) -> None:
    out = llama_export.out

    def run(expected: Path) -> subprocess.CompletedProcess[str]:
        # The exact command line of torch_to_nnef TractCli.assert_io_cmd_str for tract >= 0.22.
        cmd = [str(tract_launcher), str(out / "model.nnef.tgz"), "--nnef-tract-core"]
        cmd += ["--nnef-tract-pulse", "--nnef-tract-extra", "--nnef-tract-transformers", "-O"]
        cmd += ["run", "--input-from-bundle", str(out / "example_inputs.npz")]
        cmd += ["--assert-output-bundle", str(expected), "--allow-float-casts"]
        cmd += ["--approx", "approximate"]
        return subprocess.run(cmd, check=False, capture_output=True, text=True)

    ok = run(out / "example_outputs.npz")
    assert ok.returncode == 0, ok.stderr
    with np.load(out / "example_outputs.npz") as bundle:
        wrong: dict[str, Any] = {k: bundle[k] + 1.0 for k in bundle.files}
    np.savez(tmp_path / "wrong.npz", **wrong)
    bad = run(tmp_path / "wrong.npz")
    assert bad.returncode != 0
    assert "ERROR" in bad.stderr


@pytest.mark.parametrize(
    ("model_type", "window"),
    [
        ("mistral", {"sliding_window": 3}),  # every layer slides, no layer_types
        # layer 0 full, layer 1 sliding: transformers takes a mask per kind of layer
        ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
        ("gemma3_text", {"sliding_window": 3}),
    ],
)
def test_sliding_window_decoders_run_in_tract_like_pytorch_past_the_window(
    model_type: str, window: dict[str, object], tmp_path: Path
) -> None:
    """A 6-token prompt and 3 decode steps over a window of 3: tract's archive must mask what
    lies beyond each sliding layer's window as transformers does. (torch-to-nnef's own mask is
    causal only: every one of these failed the job's check at layer 0 on the prompt; with a
    real model's window of 512 or 4096 the check's short context had hidden it.)"""
    save_tiny_family(model_type, tmp_path / "ckpt", False, head_dim=16, **window)
    exported = _export(
        tmp_path / "ckpt", tmp_path / "job", NNEFSpec(prompt_tokens=6, decode_steps=3)
    )
    verify = exported.result.summary["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"], verify
    assert all(verify["argmax_agreed"]), verify


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_every_supported_family_exports_and_runs_in_tract(model_type: str, tmp_path: Path) -> None:
    """Each encoder family the exporter accepts (besides BERT above), tiny and random; every
    decoder family is tests/integration/exporters/test_families.py's, one job each."""
    save_tiny_family(model_type, tmp_path / "ckpt", True, head_dim=16)
    NNEFExporter().check(NNEFSpec(), json.loads((tmp_path / "ckpt" / "config.json").read_text()))
    exported = _export(tmp_path / "ckpt", tmp_path / "job", NNEFSpec(decode_steps=2))
    verify = exported.result.summary["verify"]
    assert exported.result.summary["kind"] == "encoder"
    assert verify["max_abs_err"] <= verify["tolerance"], verify


NEW_DECODERS = ("mixtral",)
"""Every decoder family is exported and checked in tract by the families test
(tests/integration/exporters/test_families.py); here a mixture of experts, for the archive's
use of tract's MoE op, and the variants of two families that the families' tiny models lack."""

FALCON_7B = {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None,
             "parallel_attn": True, "ffn_hidden_size": None}  # fmt: skip
"""Falcon 7B's attention: one key/value head (multi-query), attention and MLP in parallel."""

DECODER_VARIANTS = {
    # the per-head q/k layer norms have no bias (torch-to-nnef drops such a norm's weight)
    "stablelm, qk_layernorm (StableLM 2 12B)": FamilyVariant("stablelm", {"qk_layernorm": True}),
    "falcon, multi_query (Falcon 7B)": FamilyVariant("falcon", FALCON_7B),
}


def _job_export(source: Path, root: Path, spec: NNEFSpec) -> Exported:
    """The job's path: one meta build, dispatched to the job's offload store (where a MoE's
    per-expert tensors fill transformers' packed stacks), exported from the store."""
    from tests.fixtures.offloaded import export_from_store

    settings = Settings(data_dir=root / "data")
    ctx = InMemoryContext(settings=settings, work_dir=root / "work", job_id="f" * 32)
    ctx.work_dir.mkdir(parents=True)
    result = export_from_store(NNEFExporter(), spec, source, root / "out", settings, ctx)
    return Exported(root / "out", result, ctx, root, [])


@pytest.mark.parametrize("name", [*NEW_DECODERS, *DECODER_VARIANTS])
def test_decoder_families_export_and_decode_in_tract_like_pytorch(name: str, tmp_path: Path) -> None:
    """Each family (and variant) torch-to-nnef's LLM exporter takes with what the service adds
    (``exporter._traceable``, ``shims.torch_to_nnef``), from the families' cached tiny models,
    checked in tract as every NNEF export is; a mixture of experts as tract's MoE op."""
    variant = DECODER_VARIANTS.get(name)
    source = family_checkpoint(variant.family if variant else name, variant)
    NNEFExporter().check(NNEFSpec(), json.loads((source / "config.json").read_text()))
    exported = _job_export(source, tmp_path, NNEFSpec(decode_steps=2))
    verify = exported.result.summary["verify"]
    assert exported.result.summary["kind"] == "causal_lm"
    assert verify["max_abs_err"] <= verify["tolerance"], verify
    assert all(verify["argmax_agreed"]), verify
    graph = _graph_text(exported.out / "model.nnef.tgz")
    assert ("tract_moe_ffn(" in graph) == (name in ("mixtral", "qwen2_moe", "qwen3_moe"))
