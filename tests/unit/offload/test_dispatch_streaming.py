"""Dispatch to disk and streamed forward on tiny real models: same outputs, exact I/O figures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.errors import InvalidRequest, WeightsMismatch
from service.offload.device_map import placed_bytes, resolve_device_map
from service.offload.streaming import offloaded_modules, streamed, streamed_forward
from service.offload.tensor import StoreTensor
from service.stage import InMemoryContext, Phase
from tests.fixtures.models import sample_inputs
from tests.fixtures.moe import save_moe
from tests.unit.offload.conftest import OpenModelFactory, eager_output

CASES = [
    ("llama", "safetensors", False),
    ("llama", "safetensors", True),
    ("llama", "bin-sharded", False),
    ("llama", "bin", True),
    ("bert", "safetensors", False),
    ("bert", "bin", False),
]


@pytest.mark.parametrize(("arch", "kind", "tied"), CASES)
def test_all_on_disk_streamed_forward_equals_the_in_memory_model(
    tiny_checkpoint: object, open_model: OpenModelFactory, ctx: InMemoryContext, arch: str,
    kind: str, tied: bool,
) -> None:
    m = open_model(tiny_checkpoint(arch, kind, tied=tied))  # type: ignore[operator]
    built, store = m.built, m.store
    result = m.to_disk()
    out, stats = streamed_forward(built.model, sample_inputs(arch))  # type: ignore[arg-type]

    assert torch.equal(out, eager_output(arch, tied))  # type: ignore[arg-type]

    params = dict(built.model.named_parameters())  # tied ones once
    assert all(isinstance(p, StoreTensor) for p in params.values())
    n_bytes = sum(p.nbytes for p in params.values())
    in_place = kind == "safetensors"
    assert result.placed == {
        "cpu": 0,
        "disk_ref": len(params) if in_place else 0,
        "disk_owned": 0 if in_place else len(params),
    }
    # Each module pages its own weights in once per forward; a tied head reads the shared
    # embedding a second time.
    tied_extra = [params[target] for target in built.keys.tied.values()]
    assert store.reloads == stats.tensors_loaded == len(params) + len(tied_extra)
    assert store.bytes_read == stats.bytes_loaded == n_bytes + sum(t.nbytes for t in tied_extra)
    metrics = store.metrics()
    assert metrics["bytes_written"] == (0 if in_place else n_bytes)
    assert metrics["bytes_referenced"] == (n_bytes if in_place else 0)
    assert Phase.OFFLOAD in ctx.phases_seen
    assert ctx.details["offload"]["placed"] == result.placed


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_per_expert_moe_fills_the_models_stacks_in_place_and_computes_like_transformers(
    open_model: OpenModelFactory, tmp_path: Path, family: str
) -> None:
    """The Hub's layout (one tensor per expert) into transformers 5's packed expert stacks:
    every stack referenced in the checkpoint's file run by run, nothing copied, nothing
    missing, and the streamed forward equals the in-memory model's."""
    model = save_moe(family, tmp_path / family, "per_expert", hidden=16, tokenizer=False)
    m = open_model(tmp_path / family)
    assert m.built.keys.missing == [] and m.built.keys.unexpected == []
    result = m.to_disk()
    params = dict(m.built.model.named_parameters())
    assert result.placed == {"cpu": 0, "disk_ref": len(params), "disk_owned": 0}
    assert result.missing == [] and m.store.metrics()["bytes_written"] == 0
    ids = torch.tensor([[3, 17, 250, 41, 9]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out, _ = streamed_forward(m.built.model, inputs)
    with torch.no_grad():
        assert torch.equal(out, model(**inputs).logits)


def test_reloads_grow_by_exactly_one_pass_per_forward(
    llama_safetensors_dir: Path, open_model: OpenModelFactory
) -> None:
    m = open_model(llama_safetensors_dir)
    built, store = m.built, m.store
    m.to_disk()
    streamed_forward(built.model, sample_inputs("llama"))
    first = (store.reloads, store.bytes_read)
    streamed_forward(built.model, sample_inputs("llama"))
    assert (store.reloads, store.bytes_read) == (2 * first[0], 2 * first[1])


def test_paging_holds_one_module_at_a_time(
    llama_safetensors_dir: Path, open_model: OpenModelFactory
) -> None:
    m = open_model(llama_safetensors_dir)
    built = m.built
    m.to_disk()
    _, stats = streamed_forward(built.model, sample_inputs("llama"))
    largest = max(
        sum(p.nbytes for p in m._parameters.values() if p is not None)
        for m in offloaded_modules(built.model)
    )
    assert stats.peak_resident_bytes == largest
    assert all(isinstance(p, StoreTensor) for p in built.model.parameters())


def test_a_failing_forward_leaves_weights_offloaded(
    llama_safetensors_dir: Path, open_model: OpenModelFactory
) -> None:
    m = open_model(llama_safetensors_dir)
    built = m.built
    m.to_disk()
    bad_ids = torch.full((1, 4), 10_000)  # out of the vocabulary: the embedding raises
    with pytest.raises(IndexError), torch.inference_mode(), streamed(built.model):
        built.model(input_ids=bad_ids)
    assert all(isinstance(p, StoreTensor) for p in built.model.parameters())


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_auto_map_fills_the_ram_budget_with_whole_layers_and_spills_the_rest(
    tiny_checkpoint: object, open_model: OpenModelFactory, ctx: InMemoryContext, arch: str
) -> None:
    m = open_model(tiny_checkpoint(arch, "safetensors"))  # type: ignore[operator]
    built = m.built
    budget = sum(p.nbytes for p in built.model.parameters()) // 2
    result = m.dispatch(max_memory=budget)
    out, _ = streamed_forward(built.model, sample_inputs(arch))  # type: ignore[arg-type]
    assert torch.equal(out, eager_output(arch))  # type: ignore[arg-type]
    assert set(result.device_map.values()) == {"cpu", "disk"}
    split_class = built.no_split_module_classes[-1]  # LlamaDecoderLayer / BertLayer
    for name, module in built.model.named_modules():
        if type(module).__name__ == split_class:
            places = {isinstance(p, StoreTensor) for p in module.parameters()}
            assert len(places) == 1, f"{name} was split between RAM and disk"
    totals = placed_bytes(built.model, result.device_map, built.dtype)
    assert 0 < totals["cpu"] <= budget
    on_cpu = sum(p.nbytes for p in built.model.parameters() if not isinstance(p, StoreTensor))
    assert on_cpu == totals["cpu"]
    assert ctx.details["offload"]["device_map"]["modules"]["disk"] > 0


def test_explicit_device_map_is_honoured(
    llama_safetensors_dir: Path, open_model: OpenModelFactory
) -> None:
    explicit = {
        "model.embed_tokens": "cpu",
        "model.layers": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }
    m = open_model(llama_safetensors_dir)
    built = m.built
    m.dispatch(max_memory="1GiB", device_map=explicit)
    out, _ = streamed_forward(built.model, sample_inputs("llama"))
    assert torch.equal(out, eager_output("llama"))
    params = dict(built.model.named_parameters())
    assert not isinstance(params["model.embed_tokens.weight"], StoreTensor)
    assert isinstance(params["model.layers.1.mlp.up_proj.weight"], StoreTensor)
    assert isinstance(params["lm_head.weight"], StoreTensor)


@pytest.mark.parametrize(
    ("device_map", "message"),
    [
        ({"model.nope": "disk", "": "cpu"}, "not a module"),
        ({"model.layers": "disk"}, "without a placement"),
        ({"": "cuda:0"}, "only 'cpu' and 'disk'"),
    ],
)
def test_bad_explicit_device_maps_are_invalid_requests(
    llama_safetensors_dir: Path, open_model: OpenModelFactory, device_map: dict[str, str],
    message: str,
) -> None:
    built = open_model(llama_safetensors_dir).built
    with pytest.raises(InvalidRequest, match=message):
        resolve_device_map(built.model, device_map, "1GiB")


def test_checkpoint_missing_a_weight_is_a_weights_mismatch(
    llama_safetensors_dir: Path, open_model: OpenModelFactory, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(llama_safetensors_dir, broken)
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    m = open_model(broken)
    built = m.built
    assert built.keys.missing == ["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightsMismatch, match="down_proj"):
        m.to_disk()


def test_quantized_dispatch_keeps_packed_weights_offloaded(
    llama_safetensors_dir: Path, open_model: OpenModelFactory
) -> None:
    m = open_model(llama_safetensors_dir)
    built, store = m.built, m.store
    result = m.to_disk(quantization="q8_0")
    out, stats = streamed_forward(built.model, sample_inputs("llama"))
    reference = eager_output("llama")
    assert not torch.equal(out, reference)
    assert float((out - reference).abs().max()) < 0.05 * float(reference.abs().max())
    packed = [n for n in store.names() if store.entry(n).encoding == "q8_0"]
    assert (
        len(packed) == result.placed["disk_owned"] == 16
    )  # 7 linears x 2 layers, embed, head; norms stay raw
    assert stats.bytes_loaded > store.bytes_read  # dequantized floats > packed bytes read


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_huge_linears_and_embeddings_are_paged_in_slices(
    tiny_checkpoint: object, open_model: OpenModelFactory, arch: str
) -> None:
    m = open_model(tiny_checkpoint(arch, "safetensors"))  # type: ignore[operator]
    built, store = m.built, m.store
    page = 2048  # bytes: every Linear/Embedding of the tiny models is "huge" at this page size
    m.to_disk()
    inputs = sample_inputs(arch)  # type: ignore[arg-type]
    out, stats = streamed_forward(built.model, inputs, page_bytes=page)
    reference = eager_output(arch)  # type: ignore[arg-type]
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    params = dict(built.model.named_parameters())
    # still one reload per weight per forward, but never more than a page of it at once
    assert store.reloads == stats.tensors_loaded == len(params)
    assert stats.peak_resident_bytes <= max(
        page, max(p.nbytes for p in params.values() if p.dim() == 1)
    )
    # embeddings read only the rows of the ids present
    ids = inputs["input_ids"]
    embed = [n for n in params if n.endswith("embed_tokens.weight") or "word_embeddings" in n]
    row_bytes = params[embed[0]].nbytes // params[embed[0]].shape[0]
    assert store.bytes_read < sum(p.nbytes for p in params.values())
    assert row_bytes * len(torch.unique(ids)) <= params[embed[0]].nbytes
    assert all("forward" not in vars(m) for m in built.model.modules())  # patches undone


def test_job_store_figures_reach_the_job_json_and_get_v1_offload(
    llama_bin_dir: Path, open_model: OpenModelFactory, ctx: InMemoryContext
) -> None:
    from service.offload.dispatch import publish_offload_metrics
    from service.offload.store import open_job_store
    from service.offload.usage import offload_usage

    store = open_job_store(ctx.settings, "job-1", llama_bin_dir)
    m = open_model(llama_bin_dir)
    result = m.dispatch(store, max_memory="40KB")
    streamed_forward(m.built.model, sample_inputs("llama"))
    section = publish_offload_metrics(store, ctx, result)
    assert ctx.metrics["offload_reloads"] == store.reloads > 0
    assert ctx.metrics["offload_bytes_written"] == section["bytes_written"] > 0
    usage = offload_usage(ctx.settings)["jobs"]["job-1"]
    assert (usage["reloads"], usage["bytes_read"]) == (store.reloads, store.bytes_read)
    assert usage["tensors_written"] == result.placed["disk_owned"]
    store.close()
    assert offload_usage(ctx.settings)["jobs"] == {}


def test_a_cancelled_job_stops_between_modules(
    llama_safetensors_dir: Path, open_model: OpenModelFactory, ctx: InMemoryContext
) -> None:
    from service.errors import JobCancelled

    m = open_model(llama_safetensors_dir)
    built, store = m.built, m.store
    m.to_disk()
    ctx.cancel_event.set()
    with pytest.raises(JobCancelled):
        streamed_forward(built.model, sample_inputs("llama"), check_abort=ctx.check_abort)
    assert store.reloads == 0
    assert all(isinstance(p, StoreTensor) for p in built.model.parameters())
