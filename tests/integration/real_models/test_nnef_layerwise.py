"""tract checking a real SmolLM2 NNEF archive block by block, as it does when the archive does not
fit the memory tract may use: the blocks are cut from the shipped archive (its graph's own
statements, its own weight files), fed PyTorch's activations, and judged like the whole check.

The float16 SmolLM2 variants come from ``tests.fixtures.real_models`` (no network)."""

from __future__ import annotations

import json
import re
import tarfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from service.checkpoint import open_checkpoint
from service.checkpoint.headers import local_file_header
from service.config import Settings
from service.errors import VerificationFailed
from service.exporters.common.offloaded_model import offloaded_model
from service.exporters.nnef import NNEFSpec
from service.exporters.nnef.layerwise import (
    MIN_VOCAB_CHUNK_BYTES,
    cut_blocks,
    unpack,
    verify_causal_lm_layerwise,
)
from service.exporters.nnef.plan import block_weight_bytes, tract_peaks
from service.exporters.nnef.verify import IOSpec, verify_causal_lm
from service.offload.build import build_on_meta
from service.shims.torch_to_nnef import weights_only_unpickling
from service.verification.reference import GreedyReference, greedy_reference, prompt_ids
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.real_models import Variant, real_variant
from tests.integration.exporters.test_nnef import scale_weight
from tests.unit.exporters.nnef.test_nnef import Exported, _export

SMOLLM2_F16 = Variant(tie="output", config_keys="v4", dtype="float16", layers=4)
STEPS = 2


@pytest.fixture(scope="module")
def smollm2_f16() -> Path:
    return real_variant("smollm2", SMOLLM2_F16)


@pytest.fixture(scope="module")
def exported(smollm2_f16: Path, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The 4-layer float16 SmolLM2 exported and checked whole (the budget holds it)."""
    return _export(smollm2_f16, tmp_path_factory.mktemp("nnef"), NNEFSpec(decode_steps=STEPS))


@pytest.fixture(scope="module")
def reference(smollm2_f16: Path, tmp_path_factory: pytest.TempPathFactory) -> GreedyReference:
    """PyTorch's decode with every layer's output at every position (weights streamed)."""
    offload = tmp_path_factory.mktemp("offload")
    with open_checkpoint(smollm2_f16) as ckpt:
        built = offloaded_model(build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=offload)
        vocab = int(built.config.vocab_size)
        with weights_only_unpickling():
            return greedy_reference(
                built.module, prompt_ids(4, vocab), STEPS, record_layers=True, record_hidden=True
            )


def _io(out: Path) -> IOSpec:
    return IOSpec.from_json(json.loads((out / "io.json").read_text()))


def _tolerance(exported: Exported) -> tuple[float, float]:
    verify = exported.result.summary["verify"]
    # The whole check's tolerance is atol + rtol * max|logits|; give the block check the same.
    return float(verify["tolerance"]), 0.0


def test_blocks_cut_from_the_shipped_archive_cover_every_weight_it_holds(
    exported: Exported, tmp_path: Path
) -> None:
    archive = exported.out / "model.nnef.tgz"
    graph = unpack(archive, tmp_path / "unpacked")
    blocks = cut_blocks(graph, tmp_path / "unpacked", tmp_path / "blocks", 576, "f16")
    names = ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
    assert [b.name for b in blocks] == names
    with tarfile.open(archive) as tar:
        shipped = {m.name.removesuffix(".dat") for m in tar.getmembers() if m.name.endswith(".dat")}
    used = [w for b in blocks for w in b.weights]
    assert set(used) == shipped  # nothing of the artifact goes unchecked
    # Each weight is run once, but the tied embedding (the lookup and the head) and
    # the constants every layer reads (the causal mask's, the rotary frequencies).
    shared = {w for w in used if used.count(w) > 1}
    assert "model.model.embed_tokens.weight" in shared
    assert shared - {"model.model.embed_tokens.weight"} <= {
        "full0_to_be_expanded",
        "model.model.rotary_emb.inv_freq",
    }
    assert not any(".layers." in w for w in shared)
    # A block's weight files are the shipped bytes themselves (hard links), not a re-export.
    down = tmp_path / "blocks" / "block-003" / "model.model.layers.2.mlp.down_proj.weight.dat"
    assert down.stat().st_ino == (down.parents[2] / "unpacked" / down.name).stat().st_ino
    assert max(b.weight_bytes for b in blocks) < sum(b.weight_bytes for b in blocks) / 2


def test_the_vocabulary_matrix_runs_in_chunks_of_the_shipped_rows_no_larger_than_16_mib(
    exported: Exported, tmp_path: Path
) -> None:
    """The 54 MiB float16 embedding (tied: the head too) outweighs a 6.8 MiB layer: the lookup
    and the head run in chunks of its rows, whose files hold the shipped bytes in order."""
    graph = unpack(exported.out / "model.nnef.tgz", tmp_path / "unpacked")
    blocks = cut_blocks(graph, tmp_path / "unpacked", tmp_path / "blocks", 576, "f16")
    shipped = (tmp_path / "unpacked" / "model.model.embed_tokens.weight.dat").read_bytes()
    for block in (blocks[0], blocks[-1]):
        assert len(block.chunks) == 4, block
        assert block.weight_bytes <= MIN_VOCAB_CHUNK_BYTES + 64 * 1024  # and the final norm
        assert [(c["begin"], c["end"]) for c in block.chunks][-1][1] == 49152
        rows = b""
        for chunk in block.chunks:
            (dat,) = (tmp_path / "blocks" / str(chunk["directory"])).glob("*.rows-*.dat")
            data = dat.read_bytes()
            count = int(chunk["end"]) - int(chunk["begin"])  # type: ignore[call-overload]
            assert int.from_bytes(data[12:16], "little") == count
            assert data[:128][:4] == shipped[:4] and data[16:128] == shipped[16:128]
            rows += data[128:]
            text = (dat.parent / "graph.nnef").read_text()
            assert f"shape = [{count}, 576]" in text and "shape = [49152, 576]" not in text
        assert rows == shipped[128:]
    assert max(b.weight_bytes for b in blocks[1:-1]) < 8 << 20


def test_block_by_block_check_agrees_with_the_whole_check_on_real_smollm2(
    exported: Exported, reference: GreedyReference, tmp_path: Path
) -> None:
    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    atol, rtol = _tolerance(exported)
    whole = verify_causal_lm(archive, io_spec, reference, atol, rtol, work=tmp_path / "whole")
    layerwise = verify_causal_lm_layerwise(
        archive, io_spec, reference, atol, rtol, work=tmp_path / "layerwise"
    )
    assert whole.extra["mode"] == "whole" and layerwise.extra["mode"] == "layerwise"
    assert layerwise.tokens == whole.tokens and all(layerwise.argmax_agreed)
    assert layerwise.max_abs_err <= layerwise.tolerance
    # Fed PyTorch's last layer output, the head's logits are at least as close as the whole
    # decode's, whose error adds up over the layers.
    assert layerwise.max_abs_err <= whole.max_abs_err + 1e-6
    blocks = layerwise.extra["blocks"]
    names = ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
    assert [b["block"] for b in blocks] == names
    assert blocks[0]["chunks"] == blocks[-1]["chunks"] == 4
    for block in blocks[1:]:  # the lookup is judged through layer 0, which it feeds
        assert 0 <= block["max_abs_err"] <= block["tolerance"], block
    assert all(b["tract_peak_rss_bytes"] > 0 for b in blocks)
    # tract's peak is a block's, a 16 MiB chunk of the vocabulary at most, not the model's. The
    # whole 54 MiB head, one block before chunking, peaked at 163 MiB (tract widens a float16
    # matrix to float32 for its matmul); the chunked head measured 95-102 MiB alone and 125 MiB
    # inside a full run at load 8 (the allocator's share moves with load), so the bound sits
    # between the two: 64 MiB + 5 x the chunk = 144 MiB.
    assert max(b["tract_peak_rss_bytes"] for b in blocks) < 64 * 2**20 + 5 * 16 * 2**20, blocks
    assert layerwise.peak_rss_bytes == max(b["tract_peak_rss_bytes"] for b in blocks)


SUB_LAYER_BLOCK = 1 << 20
"""A block setting below SmolLM2's layer (6.8 MiB in float16): its attention and MLP run apart,
and its MLP matrices (1.7 MiB each) and vocabulary (54 MiB) in blocks of their rows."""


def test_blocks_below_a_layer_give_the_whole_layer_blocks_verdict_and_figures(
    exported: Exported, reference: GreedyReference, tmp_path: Path
) -> None:
    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    atol, rtol = _tolerance(exported)
    layers = verify_causal_lm_layerwise(
        archive, io_spec, reference, atol, rtol, work=tmp_path / "layers"
    )
    below = verify_causal_lm_layerwise(
        archive, io_spec, reference, atol, rtol, work=tmp_path / "below",
        block_bytes=SUB_LAYER_BLOCK,
    )  # fmt: skip
    assert below.tokens == layers.tokens and below.argmax_agreed == layers.argmax_agreed
    assert all(below.argmax_agreed) and below.max_abs_err <= below.tolerance
    # the same graph, weights and float16: only where a boundary rounds may the figures move
    assert abs(below.max_abs_err - layers.max_abs_err) <= 0.1 * layers.tolerance
    blocks = below.extra["blocks"]
    names = [b["block"] for b in blocks]
    for layer in range(4):
        mine = [n for n in names if n.startswith(f"layer {layer} ")]
        assert f"layer {layer} attention" in mine and f"layer {layer} mlp" in mine, names
        assert {f"layer {layer} mlp.{m}_proj rows" for m in ("gate", "up", "down")} <= set(mine)
    judged = {b["block"]: b for b in blocks if "max_abs_err" in b}
    whole = {b["block"]: b for b in layers.extra["blocks"] if "max_abs_err" in b}
    for layer in range(4):  # each layer's output, judged where its last block gives it
        a, b = judged[f"layer {layer} mlp"], whole[f"layer {layer}"]
        assert a["max_abs_err"] <= a["tolerance"] and a["tolerance"] == b["tolerance"]
        assert abs(a["max_abs_err"] - b["max_abs_err"]) <= 0.1 * b["tolerance"], (a, b)
    # no block holds more than the setting; the MLP matrices ran in 2 blocks of rows each
    assert max(b["weight_bytes"] for b in blocks) <= SUB_LAYER_BLOCK
    mlp_rows = [b for b in blocks if re.fullmatch(r"layer \d mlp\.\w+_proj rows", b["block"])]
    assert len(mlp_rows) == 12 and all(b.get("chunks") == 2 for b in mlp_rows), mlp_rows
    assert max(b["tract_peak_rss_bytes"] for b in blocks) < max(
        b["tract_peak_rss_bytes"] for b in layers.extra["blocks"]
    )


def _scale_rows(archive: Path, dest: Path, member: str, rows: range, factor: float) -> None:
    """Copy ``archive`` with rows ``rows`` of the 2-D float16 tensor file ``member`` scaled."""
    with tarfile.open(archive) as src:
        payloads = {m.name: f.read() for m in src.getmembers() if (f := src.extractfile(m))}
    raw = bytearray(payloads[member])
    columns = int.from_bytes(raw[16:20], "little")
    data = np.frombuffer(bytes(raw[128:]), dtype=np.float16).reshape(-1, columns).copy()
    data[rows.start : rows.stop] *= np.float16(factor)
    raw[128:] = data.tobytes()
    payloads[member] = bytes(raw)
    with tarfile.open(dest, "w:gz", compresslevel=0) as out:
        for name, payload in payloads.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            out.addfile(info, __import__("io").BytesIO(payload))


def test_a_wrong_weight_in_one_row_block_of_a_matrix_fails_naming_its_layer_and_blocks(
    exported: Exported, reference: GreedyReference, tmp_path: Path
) -> None:
    """Rows 400-409 of layer 2's down projection (576 rows of 1536 float16: blocks of 341
    rows at 1 MiB, so the second block's) scaled by -50: that layer fails, the message names
    it and the blocks it ran as, the row-split one among them."""
    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    atol, rtol = _tolerance(exported)
    bad = tmp_path / "rows.nnef.tgz"
    _scale_rows(archive, bad, "model.model.layers.2.mlp.down_proj.weight.dat", range(400, 410), -50)
    with pytest.raises(VerificationFailed) as failed:
        verify_causal_lm_layerwise(bad, io_spec, reference, atol, rtol, work=tmp_path / "r",
                                   block_bytes=SUB_LAYER_BLOCK)  # fmt: skip
    message = str(failed.value)
    assert re.search(r"tract's block for model\.layers\.2 differs from PyTorch by [0-9.e+]+ "
                     r"\(tolerance [0-9.e+]+\), fed PyTorch's input", message), message  # fmt: skip
    assert re.search(r"it ran as layer 2 attention.*, layer 2 mlp\.down_proj rows, layer 2 mlp\)",
                     message), message  # fmt: skip
    # the same archive checked with whole layers fails on the same layer
    with pytest.raises(VerificationFailed, match=r"block for model\.layers\.2 differs"):
        verify_causal_lm_layerwise(bad, io_spec, reference, atol, rtol, work=tmp_path / "w")


def test_a_weight_broken_in_one_block_of_the_shipped_archive_fails_naming_that_layer(
    exported: Exported, reference: GreedyReference, tmp_path: Path
) -> None:
    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    atol, rtol = _tolerance(exported)
    bad = tmp_path / "layer2.nnef.tgz"
    scale_weight(archive, bad, "model.model.layers.2.mlp.down_proj.weight.dat")
    with pytest.raises(VerificationFailed, match=r"tract's block for model\.layers\.2 differs "
                       r"from PyTorch by [0-9.e+]+ \(tolerance [0-9.e+]+\), fed PyTorch's input"):  # fmt: skip
        verify_causal_lm_layerwise(bad, io_spec, reference, atol, rtol, work=tmp_path / "l2")


def test_a_broken_head_fails_the_block_by_block_check_after_every_layer_agrees(
    exported: Exported, reference: GreedyReference, tmp_path: Path
) -> None:
    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    atol, rtol = _tolerance(exported)
    bad = tmp_path / "norm.nnef.tgz"
    scale_weight(archive, bad, "model.model.norm.weight.dat")
    with pytest.raises(VerificationFailed, match=r"every layer's block agrees: the divergence "
                       r"is in the final norm or output head"):  # fmt: skip
        verify_causal_lm_layerwise(bad, io_spec, reference, atol, rtol, work=tmp_path / "head")


@pytest.mark.timeout(900)
def test_a_budget_below_the_whole_archive_checks_real_smollm2_block_by_block(
    tmp_path: Path,
) -> None:
    """The first 8 real layers of SmolLM2 in float16 (where the archive outweighs one block
    with the embedding): a tract budget between one block's need and the whole archive's makes
    the job check it layer by layer, within that budget, and say so in its summary."""
    source = real_variant("smollm2", Variant(tie="output", config_keys="v4", dtype="float16",
                                             layers=8))  # fmt: skip
    tensors = [t for f in source.glob("*.safetensors") for t in local_file_header(f)]
    whole, layerwise = tract_peaks(
        sum(t.nbytes for t in tensors), block_weight_bytes((t.name, t.nbytes) for t in tensors)
    )
    budget = (whole + layerwise) // 2
    assert layerwise < budget < whole
    settings = Settings(data_dir=tmp_path / "data", tract_max_memory=str(budget))
    done = _export(source, tmp_path, NNEFSpec(decode_steps=STEPS), settings)
    verify = done.result.summary["verify"]
    assert verify["mode"] == "layerwise", verify
    assert verify["tract_max_memory_bytes"] == budget
    assert len(verify["blocks"]) == 10 and all(verify["argmax_agreed"])
    assert verify["blocks"][0]["block"] == "embedding"
    assert all(b["max_abs_err"] <= b["tolerance"] for b in verify["blocks"][1:]), verify["blocks"]
    assert verify["tract_peak_rss_bytes"] < budget
    assert np.isfinite(verify["max_abs_err"])


def test_a_tiny_llama_job_under_a_budget_for_one_block_is_checked_layer_by_layer(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    source = tiny_checkpoint("llama", "safetensors")
    tensors = [t for f in source.glob("*.safetensors") for t in local_file_header(f)]
    block = block_weight_bytes((t.name, t.nbytes) for t in tensors)
    _, layerwise = tract_peaks(sum(t.nbytes for t in tensors), block)
    settings = Settings(data_dir=tmp_path / "data", tract_max_memory=str(layerwise))
    done = _export(source, tmp_path, NNEFSpec(decode_steps=2), settings)
    verify = done.result.summary["verify"]
    assert verify["mode"] == "layerwise", verify
    assert [b["block"] for b in verify["blocks"]] == ["embedding", "layer 0", "layer 1", "head"]
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"])


def test_block_by_block_logits_on_the_fixed_text_match_the_whole_archives(
    exported: Exported, smollm2_f16: Path, tmp_path: Path
) -> None:
    """The logits check where tract cannot hold the archive: the blocks run one after the
    other over the fixed text, each fed the block before it (tract's own activations, not
    PyTorch's), and give the whole archive's figures against transformers' float32 run."""
    import transformers

    from service.exporters.nnef.verify import check_logits
    from service.verification.independent import independent_reference
    from service.verification.logits import FIXED_TEXT, runtime_bounds
    from service.verification.reference import fixed_input_ids

    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    config = json.loads((smollm2_f16 / "config.json").read_text())
    independent = independent_reference(
        smollm2_f16, transformers.LlamaForCausalLM, fixed_input_ids(config["vocab_size"]),
        FIXED_TEXT, 1 << 34, tmp_path / "reference",
    )  # fmt: skip
    whole = check_logits(archive, io_spec, "float16", None, independent, work=tmp_path / "whole")
    cut_blocks(unpack(archive, tmp_path / "unpacked"), tmp_path / "unpacked", tmp_path / "blocks",
               576, "f16")  # fmt: skip
    blocks = check_logits(archive, io_spec, "float16", None, independent,
                          work=tmp_path / "layerwise", blocks=tmp_path / "blocks")  # fmt: skip
    assert (whole["mode"], blocks["mode"]) == ("whole", "layerwise")
    assert (whole["scored_by"], blocks["scored_by"]) == ("steps", "prefill")
    assert blocks["positions"] == whole["positions"] == 126
    assert blocks["bounds"] == whole["bounds"] == asdict(runtime_bounds("float16"))
    # the same graph and weights in the same float16: only where tract cuts its fused kernels
    # (a boundary is stored as float16) may differ
    assert abs(blocks["kl_mean"] - whole["kl_mean"]) < 1e-3, (whole, blocks)
    assert abs(blocks["top1"] - whole["top1"]) <= 2 / 126, (whole, blocks)


@pytest.mark.parametrize("block_bytes", [None, SUB_LAYER_BLOCK], ids=["layers", "below"])
def test_block_by_block_prefill_gives_the_logits_of_one_position_a_step(
    exported: Exported, tmp_path: Path, block_bytes: int | None
) -> None:
    """Each block run once a chunk (the head's statements copied onto every position) gives
    the logits the shipped archive gives run one position a step, tract's caches fed back;
    below a layer too, each block fed the values the blocks before it computed."""
    from service.exporters.nnef import tract_cli
    from service.verification.logits import log_softmax, window_request

    archive, io_spec = exported.out / "model.nnef.tgz", _io(exported.out)
    cut_blocks(unpack(archive, tmp_path / "unpacked"), tmp_path / "unpacked", tmp_path / "blocks",
               576, "f16", block_bytes)  # fmt: skip
    vocab = int(io_spec.outputs[0].shape[-1])
    chunks = np.random.default_rng(1).integers(0, vocab, size=(2, 32))
    request: dict[str, np.ndarray] = {**window_request(chunks)}
    request["cache_shapes"] = np.asarray(
        [[0 if d == "P" else int(d) for d in t.shape] for t in io_spec.inputs[1:]], dtype=np.int64
    )
    request["cache_dtypes"] = np.asarray([t.dtype for t in io_spec.inputs[1:]])
    steps = tract_cli.run_chunks(tract_cli.load_runnable(archive), request)
    blocks = tract_cli.run_layerwise_chunks(tmp_path / "blocks", request)
    assert str(blocks["scored_by"]) == "prefill"
    assert blocks["logits"].shape == steps.shape == (2, 15, vocab)
    a, b = log_softmax(steps.reshape(-1, vocab)), log_softmax(blocks["logits"].reshape(-1, vocab))
    kl = float((np.exp(a) * (a - b)).sum(axis=-1).mean())
    assert kl < 1e-3, kl
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 28 / 30


def test_a_tiny_llama_job_with_a_block_setting_below_its_layers_checks_attention_mlp_and_rows(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """MODELPREP_TRACT_BLOCK_BYTES below the tiny Llama's layer (146 KiB) and its matrices
    (16-32 KiB in float32): the job cuts each layer into its attention, its MLP and its
    matrices' rows, and gives the verdict and figures of whole-layer blocks."""
    source = tiny_checkpoint("llama", "safetensors")
    tensors = [t for f in source.glob("*.safetensors") for t in local_file_header(f)]
    block = 12000
    sizes = [(t.name, t.nbytes) for t in tensors]
    assert block_weight_bytes(sizes, block) == block < block_weight_bytes(sizes)
    # a tract budget for one whole layer's block (the same in both runs), not the archive
    _, layerwise = tract_peaks(sum(t.nbytes for t in tensors), block_weight_bytes(sizes))
    reports = {}
    for name, setting in (("layers", "1GiB"), ("below", str(block))):
        settings = Settings(data_dir=tmp_path / name / "data", tract_max_memory=str(layerwise),
                            tract_block_bytes=setting)  # fmt: skip
        done = _export(source, tmp_path / name, NNEFSpec(decode_steps=2), settings)
        reports[name] = done.result.summary["verify"]
    layers, below = reports["layers"], reports["below"]
    assert layers["mode"] == below["mode"] == "layerwise"
    assert [b["block"] for b in layers["blocks"]] == ["embedding", "layer 0", "layer 1", "head"]
    names = [b["block"] for b in below["blocks"]]
    assert {"layer 0 attention", "layer 0 mlp", "layer 1 mlp.down_proj rows"} <= set(names)
    assert max(b["weight_bytes"] for b in below["blocks"]) <= block
    assert below["tokens"] == layers["tokens"] and all(below["argmax_agreed"])
    assert abs(below["max_abs_err"] - layers["max_abs_err"]) <= 0.1 * layers["tolerance"]
