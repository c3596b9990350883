"""The assumptions service.adapters.torch_to_nnef makes about torch-to-nnef's internals, each
named in the failure message so that an upgrade that breaks one says which."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from service.adapters import torch_to_nnef as t2n


class _Weights:
    """A tensor source holding real tensors by name (what a checkpoint reader does from disk)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.reads: list[str] = []

    def read(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return self.tensors[name].clone()


def test_reload_goes_through_reload_unmanaged_and_update_values_rewrites(tmp_path: Path) -> None:
    weights = _Weights({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    read_bytes: list[int] = []
    tensor = t2n.CheckpointTensor.create(
        weights, "w", "layer.w", (2, 3), torch.float16, tmp_path, read_bytes.append
    )
    value = tensor.reload()
    assert weights.reads == ["w"], (
        "assumption broken: OffloadedTensor.reload() reads through _reload_unmanaged(device)"
    )
    assert value.dtype == torch.float16 and torch.equal(value.float(), weights.tensors["w"])
    assert read_bytes == [6 * 4]
    tensor.update_values(torch.ones(2, 3, dtype=torch.float16))
    assert torch.equal(tensor.reload(), torch.ones(2, 3, dtype=torch.float16)), (
        "assumption broken: update_values(values, strict_shape, strict_dtype) replaces the "
        "payload that later reloads return"
    )


def test_the_nnef_writer_has_the_hooks_the_adapter_swaps() -> None:
    from torch_to_nnef.nnef_io import writer

    for name, params in {
        "write_offloaded_tensor": ["tensor", "filename", "quantized"],
        "tgz_compress": ["dir_path", "file_path", "compression_level"],
        "write_nnef_tensor": None,
        "maybe_torch_to_np": None,
    }.items():
        func = getattr(writer, name, None)
        assert callable(func), f"assumption broken: torch_to_nnef.nnef_io.writer.{name} exists"
        if params is not None:
            got = list(inspect.signature(func).parameters)[: len(params)]
            assert got == params, f"assumption broken: writer.{name}({', '.join(params)})"
    original = writer.write_offloaded_tensor
    with t2n.checkpoint_tensors_writable():
        assert writer.write_offloaded_tensor is not original
    assert writer.write_offloaded_tensor is original


def test_q4_dequantize_has_an_eager_original() -> None:
    from torch_to_nnef.tensor.quant.base import QScalePerGroupF16

    assert "_dequantize" in QScalePerGroupF16.__dict__, (
        "assumption broken: QScalePerGroupF16._dequantize is a class attribute"
    )
    assert callable(getattr(QScalePerGroupF16, "_dequantize_original", None)), (
        "assumption broken: QScalePerGroupF16._dequantize_original is the uncompiled dequantize"
    )


def test_offloaded_payloads_reload_weights_only(tmp_path: Path) -> None:
    tensor = t2n.CheckpointTensor.create(
        _Weights({"w": torch.zeros(4)}), "w", "w", (4,), torch.float32, tmp_path
    )
    with t2n.weights_only_unpickling(), t2n.job_tempdir(tmp_path / "tmp") as tmp:
        tensor.update_values(torch.full((4,), 2.0))  # torch-to-nnef writes a .pt payload ...
        assert torch.equal(tensor.reload(), torch.full((4,), 2.0)), (
            "assumption broken: torch-to-nnef reloads its offloaded payloads with torch.load, "
            "which works weights-only"
        )
        import tempfile

        assert tempfile.gettempdir() == str(tmp)
    assert not (tmp_path / "tmp").exists()


def test_the_llm_exporter_leaks_its_cache_patch_and_the_adapter_undoes_it() -> None:
    from torch_to_nnef_llm.models.base import ctx_dtype_dyn_cache
    from transformers import cache_utils

    original = cache_utils.DynamicLayer.__dict__["update"]
    with t2n.cache_update_restored(), ctx_dtype_dyn_cache():
        assert cache_utils.DynamicLayer.__dict__["update"] is not original, (
            "assumption changed: torch-to-nnef's ctx_dtype_dyn_cache patches "
            "DynamicLayer.update (if it no longer does, cache_update_restored can go)"
        )
    assert cache_utils.DynamicLayer.__dict__["update"] is original, (
        "cache_update_restored must put DynamicLayer.update back after torch-to-nnef's export"
    )


def test_a_cached_decode_under_torch_to_nnefs_cache_patch_matches_an_uncached_one() -> None:
    """torch-to-nnef's replacement DynamicLayer.update left get_seq_length() at 0, so every cached
    step restarted positions at 0 (the SmolLM2 NNEF check's 12.9 logit drift)."""
    from torch_to_nnef_llm.models.base import ctx_dtype_dyn_cache
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35]])
    with torch.no_grad():
        uncached = model(ids, use_cache=False).logits[:, -1]
        with t2n.cache_update_restored(), ctx_dtype_dyn_cache():
            past = model(ids[:, :-1], use_cache=True).past_key_values
            assert past.get_seq_length() == ids.shape[1] - 1, (
                "the cache must count the prompt under torch-to-nnef's DynamicLayer.update"
            )
            cached = model(ids[:, -1:], past_key_values=past, use_cache=True).logits[:, -1]
    assert torch.allclose(cached, uncached, atol=1e-5), (cached - uncached).abs().max()
