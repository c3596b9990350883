"""service.shims.transformers_keys: transformers' own per-model key renaming.

If one of these fails after a transformers upgrade, ``conversion_mapping.get_model_conversion_mapping``
or ``core_model_loading.rename_source_key`` changed: the job's meta build would no longer find a
published VLM layout's weights (``WeightsMismatch`` naming ``model.vision_tower.*``).
"""

from __future__ import annotations

from accelerate import init_empty_weights
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
)

from service.shims.transformers_keys import key_renamer


def _gemma3() -> Gemma3ForConditionalGeneration:
    text = Gemma3TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8)  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4)  # fmt: skip
    with init_empty_weights():
        return Gemma3ForConditionalGeneration(config)


def test_the_published_gemma3_layout_is_renamed_to_the_modules_names() -> None:
    model = _gemma3()
    names = {n for n, _ in model.named_parameters()}
    rename = key_renamer(model)
    published = {
        "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight":
            "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",
        "language_model.model.layers.0.self_attn.q_proj.weight":
            "model.language_model.layers.0.self_attn.q_proj.weight",
        "multi_modal_projector.mm_input_projection_weight":
            "model.multi_modal_projector.mm_input_projection_weight",
    }  # fmt: skip
    for key, module_name in published.items():
        assert rename(key) == module_name and module_name in names, key


def test_a_model_without_rules_keeps_its_keys() -> None:
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    rename = key_renamer(model)
    assert rename("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


def test_the_layout_transformers_5_saves_for_gemma3_is_named_as_published() -> None:
    """What ``save_pretrained`` writes for a Gemma 3 transformers built (``vision_tower.*``,
    no ``vision_model``) reaches llama.cpp's converter as the Hub's layout; the Hub's names
    stay as they are."""
    from service.shims.transformers_keys import published_names, unloadable_names

    model = _gemma3()
    saved = ["vision_tower.embeddings.patch_embedding.bias",
             "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
             "language_model.model.embed_tokens.weight", "multi_modal_projector.mm_soft_emb_norm.weight"]  # fmt: skip
    published = published_names(model, saved)
    assert published["vision_tower.embeddings.patch_embedding.bias"] == (
        "vision_tower.vision_model.embeddings.patch_embedding.bias"
    )
    assert published["vision_tower.encoder.layers.0.self_attn.q_proj.weight"] == (
        "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"
    )
    assert published["language_model.model.embed_tokens.weight"] == (
        "language_model.model.embed_tokens.weight"
    )
    hub = list(published.values())
    assert published_names(model, hub) == {n: n for n in hub}
    assert unloadable_names(model, saved + hub) == []
    assert unloadable_names(model, ["vision_encoder.blocks.0.qkv.weight"]) == [
        "vision_encoder.blocks.0.qkv.weight"
    ]
