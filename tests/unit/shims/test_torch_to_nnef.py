"""The assumptions service.shims.torch_to_nnef makes about torch-to-nnef's internals, each
named in the failure message so that an upgrade that breaks one says which."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from service.shims import torch_to_nnef as t2n


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


def test_counting_elements_reads_no_weight_where_the_parent_reads_it_all(
    tmp_path: Path,
) -> None:
    weights = _Weights({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    tensor = t2n.CheckpointTensor.create(weights, "w", "layer.w", (2, 3), torch.float16, tmp_path)
    plain = torch.Tensor.numel(tensor)  # what OffloadedTensor.numel() is, unpatched
    assert weights.reads == ["w"], (
        "assumption changed: OffloadedTensor.__torch_function__ reloads the payload for "
        "numel() (if it no longer does, CheckpointTensor.numel/element_size can go)"
    )
    weights.reads.clear()
    assert (tensor.numel(), tensor.element_size()) == (plain, 2)
    param = torch.nn.Parameter(tensor, requires_grad=False)
    assert param.numel() * param.element_size() == 12
    assert weights.reads == [], "counting elements read the weight back"
    tensor.update_values(torch.ones(4, 2, dtype=torch.float32), strict_shape=False)
    assert (tensor.numel(), tensor.element_size()) == (8, 4)


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


def _forward_inputs(config: object, seq: int, past: int) -> dict[str, object]:
    """What torch-to-nnef's text handler hands the model for ``seq`` new tokens after ``past``
    cached ones (one layer's worth of cache is enough for the handler)."""
    from types import SimpleNamespace

    from torch_to_nnef_llm.models.handlers.default import DefaultArchitectureHandler

    wrapper = SimpleNamespace(
        model=SimpleNamespace(config=config), force_causal_mask=True, with_dyn_cache=False
    )
    cache = [torch.zeros(1, 2, past, 8), torch.zeros(1, 2, past, 8)]
    inputs = (torch.zeros(1, seq, dtype=torch.int64), *cache)
    built = DefaultArchitectureHandler().build_forward_inputs(inputs=inputs, wrapper=wrapper)
    return dict(built.model_inputs)


def _visible(mask: torch.Tensor) -> list[list[int]]:
    """Each query's visible keys in an additive mask [1, 1, S, P+S]."""
    return [[k for k, v in enumerate(row) if v == 0] for row in mask[0, 0].tolist()]


def test_the_text_handler_passes_one_causal_mask_and_the_adapter_adds_the_window() -> None:
    from transformers import MistralConfig, Qwen2Config

    mistral = MistralConfig(sliding_window=3)
    plain = _forward_inputs(mistral, seq=2, past=3)["attention_mask"]
    assert isinstance(plain, torch.Tensor) and plain.shape == (1, 1, 2, 5), (
        "assumption broken: torch-to-nnef's DefaultArchitectureHandler.build_forward_inputs("
        "inputs=(input_ids, *past), wrapper) hands the model one additive causal mask "
        "[1, 1, S, P+S] under model_inputs['attention_mask']"
    )
    assert _visible(plain) == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]
    with t2n.sliding_window_masks():
        windowed = _forward_inputs(mistral, seq=2, past=3)["attention_mask"]
        mixed = _forward_inputs(
            Qwen2Config(use_sliding_window=True, sliding_window=3, max_window_layers=1,
                        num_hidden_layers=2),
            seq=2, past=3,
        )["attention_mask"]  # fmt: skip
        unwindowed = _forward_inputs(MistralConfig(sliding_window=None), seq=2, past=3)
    # transformers' window of 3: a query sees itself and the 2 keys before it
    assert isinstance(windowed, torch.Tensor) and _visible(windowed) == [[1, 2, 3], [2, 3, 4]]
    assert isinstance(mixed, dict) and set(mixed) == {"full_attention", "sliding_attention"}
    assert _visible(mixed["full_attention"]) == _visible(plain)
    assert _visible(mixed["sliding_attention"]) == [[1, 2, 3], [2, 3, 4]]
    assert _visible(unwindowed["attention_mask"]) == _visible(plain)  # type: ignore[arg-type]
    assert _visible(_forward_inputs(mistral, seq=2, past=3)["attention_mask"]) == _visible(plain)


def test_the_config_helper_misreads_falcon_and_gpt_neox_kv_heads_and_the_adapter_answers() -> None:
    from torch_to_nnef_llm.config import HFConfigHelper
    from transformers import FalconConfig, GPTNeoXConfig, LlamaConfig

    def heads(config: object) -> int:
        helper = HFConfigHelper.__new__(HFConfigHelper)  # only its config, no handler
        helper.conf = config
        return int(helper.get_num_kv_heads(0))

    small = {"hidden_size": 64, "num_attention_heads": 4}
    new_falcon = FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **small)
    old_falcon = FalconConfig(new_decoder_architecture=False, multi_query=True, **small)
    neox = GPTNeoXConfig(**small)
    for config, error in ((new_falcon, TypeError), (neox, AttributeError)):
        try:
            heads(config)
        except error:
            pass
        else:
            raise AssertionError(
                f"assumption changed: HFConfigHelper.get_num_kv_heads(self, layer_idx) fails on "
                f"{type(config).__name__} (if it no longer does, cache_heads_from_config can go)"
            )
    with t2n.cache_heads_from_config():
        # what the model's cache holds: FalconAttention repeats the KV groups before it
        assert heads(new_falcon) == 4 and heads(old_falcon) == 1 and heads(neox) == 4
        assert heads(LlamaConfig(num_key_value_heads=2, **small)) == 2  # the library's answer
    assert heads(LlamaConfig(num_key_value_heads=2, **small)) == 2


def test_moe_expert_stacks_are_cut_through_a_module_global_and_the_adapter_offloads_them(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    from torch_to_nnef.op.custom_extractors import moe
    from torch_to_nnef.tensor.offload import OffloadedTensor

    cut = moe.__dict__.get("_maybe_quantize_expert_weight")
    assert callable(cut) and list(inspect.signature(cut).parameters)[:3] == [
        "node", "name", "data"
    ], "assumption broken: moe._maybe_quantize_expert_weight(node, name, data, ...)"
    assert "_maybe_quantize_expert_weight(" in inspect.getsource(moe._convert_moe_to_nnef), (
        "assumption broken: _convert_moe_to_nnef cuts each stack through the module global"
    )
    node = SimpleNamespace(outputs=[SimpleNamespace(name="layer0_moe")])
    stack = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3).transpose(-1, -2)
    assert cut(node, "w1", stack, False, None, {}) is stack, (
        "assumption broken: an unquantized stack comes back as the data itself (held in RAM)"
    )
    with t2n.moe_experts_offloaded(tmp_path):
        offloaded = moe._maybe_quantize_expert_weight(node, "w1", stack, False, None, {})
        router = torch.ones(2, 4)
        assert moe._maybe_quantize_expert_weight(node, "wg", router, False, None, {}) is router
    assert moe.__dict__["_maybe_quantize_expert_weight"] is cut
    assert isinstance(offloaded, OffloadedTensor) and offloaded.nnef_name == "layer0_moe_w1"
    assert list(tmp_path.iterdir()), "the stack is written to the job's offload directory"
    assert torch.equal(offloaded.to_base_tensor(), stack)
