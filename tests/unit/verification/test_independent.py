"""transformers' independent reference computes the fixed text's chunks in one batched forward:
the same chunk logits as one forward per chunk, whole and layer by layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.verification.independent import independent_reference, text_chunks
from service.verification.logits import FIXED_TEXT, scored

LAYERED = 300_000
"""A budget below the tiny Llama's float32 weights (450 KB) holding one layer (1.7 x 148 KB):
transformers' reference runs layer by layer."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random weights and a byte-level BPE trained on the fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([FIXED_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>").save_pretrained(root)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root)
    return root


@pytest.mark.parametrize("budget", [1 << 30, LAYERED], ids=["whole", "layer-by-layer"])
def test_one_batched_forward_gives_what_one_forward_per_chunk_gives(
    tiny_llama: Path, tmp_path: Path, budget: int
) -> None:
    from transformers import LlamaForCausalLM

    ids = torch.tensor([[5, 17, 42, 9, 250, 3, 77, 120]])
    got = independent_reference(tiny_llama, LlamaForCausalLM, ids, FIXED_TEXT, budget, tmp_path)
    assert got.mode == ("whole" if budget > 1 << 20 else "layer-by-layer")
    chunks = text_chunks(tiny_llama, FIXED_TEXT)
    assert chunks is not None and got.chunks is not None and (got.chunks == chunks).all()
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    window = scored(chunks.shape[1])
    with torch.inference_mode():
        outputs = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert got.outputs.shape == outputs.shape
        torch.testing.assert_close(got.outputs, outputs, rtol=1e-5, atol=1e-6)
        for chunk, logits in zip(chunks, got.chunk_logits(), strict=True):
            one = model(input_ids=torch.from_numpy(chunk[None].astype(np.int64))).logits[0]
            kept = slice(window.start - 1, window.stop)
            np.testing.assert_allclose(logits[kept], one[kept].numpy(), rtol=1e-5, atol=1e-6)
            assert not logits[: window.start - 1].any()  # rows outside the window are zero


def test_without_outputs_no_forward_on_the_fixed_input_and_the_same_chunk_logits(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A job that reads only the fixed text's logits (a GGUF alone) skips the fixed input's
    forward; the chunk logits are those of a reference with outputs."""
    from transformers import LlamaForCausalLM

    ids = torch.tensor([[5, 17, 42, 9, 250, 3, 77, 120]])
    calls: list[int] = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: calls.append(1) if isinstance(module, LlamaForCausalLM) else None
    )
    try:
        got = independent_reference(
            tiny_llama, LlamaForCausalLM, ids, FIXED_TEXT, LAYERED, tmp_path / "a",
            with_outputs=False,
        )  # fmt: skip
    finally:
        hook.remove()
    assert got.outputs is None and len(calls) == 1  # the chunks' batched forward only
    full = independent_reference(
        tiny_llama, LlamaForCausalLM, ids, FIXED_TEXT, LAYERED, tmp_path / "b"
    )
    for a, b in zip(got.chunk_logits(), full.chunk_logits(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("block", [1 << 10, 1 << 30], ids=["projections-in-row-blocks", "loaded"])
def test_module_by_module_agrees_with_layer_by_layer(
    tiny_llama: Path, tmp_path: Path, block: int
) -> None:
    """Each module of a layer on disk apart, and (with the 1 KiB block) every projection
    read from the file a block of output rows at a time: transformers' own forward over the
    same weights, so the same outputs and chunk logits as a whole layer at a time, to float32
    summation order."""
    from transformers import LlamaForCausalLM

    ids = torch.tensor([[5, 17, 42, 9, 250, 3, 77, 120]])
    layer = independent_reference(tiny_llama, LlamaForCausalLM, ids, FIXED_TEXT, LAYERED,
                                  tmp_path / "layer")  # fmt: skip
    module = independent_reference(
        tiny_llama, LlamaForCausalLM, ids, FIXED_TEXT, LAYERED, tmp_path / "module",
        force_mode="module-by-module", block_bytes=block,
    )  # fmt: skip
    assert (layer.mode, module.mode) == ("layer-by-layer", "module-by-module")
    summary = module.summary()
    assert summary["mode"] == "module-by-module"
    # q k v o gate up down in each of the 2 layers, 64 x 64 and more: all over 1 KiB
    assert summary["projections_in_row_blocks"] == (14 if block == 1 << 10 else 0), summary
    assert summary["mapped_from_file"] == ["lm_head", "model.embed_tokens"], summary
    torch.testing.assert_close(module.outputs, layer.outputs, rtol=1e-5, atol=1e-6)
    for a, b in zip(module.chunk_logits(), layer.chunk_logits(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_mode_is_the_budget_s_whole_then_a_layer_then_a_module() -> None:
    from service.verification.independent import reference_mode

    # a 70B-wide layer: 0.86 G elements, 3.2 GiB in float32; 80 layers
    layer, params = 856 << 20, 80 * (856 << 20)
    assert reference_mode(params, layer, 2 << 40) == "whole"
    assert reference_mode(params, layer, 8 << 30) == "layer-by-layer"
    assert reference_mode(params, layer, 1 << 30) == "module-by-module"
