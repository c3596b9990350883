"""Upstream's class for a checkpoint: the architecture it dispatches on, the class that does
the work where upstream's only delegates, its ``modify_tensors`` where it would transpose
what transformers already did, and the names a VLM's tensors are handed to it under
(:func:`published_layout`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from service.errors import UnsupportedExport
from service.shims.llama_cpp_convert.loader import load_converter


def hf_architecture(config: dict[str, Any]) -> str:
    """The architecture name upstream dispatches on (``architectures[0]``; text_config's for VLMs)."""
    names = config.get("architectures") or []
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and text_config.get("architectures"):
        # upstream's get_model_architecture: a VLM's text model by its text_config's own name
        # (SmolVLM's VLlama3ForCausalLM), which upstream prefers to the top-level one
        names = text_config["architectures"]
    if names:
        return str(names[0])
    # an old config with only model_type: transformers' own auto-class tables name the class
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    for table in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        if isinstance(model_type, str) and model_type in table:
            return str(table[model_type])
    raise UnsupportedExport(
        f"config.json names no architecture and model_type {model_type!r} is not one "
        "transformers knows"
    )


def break_row_filtered(bin_dir: Path | None = None) -> bool:
    """Whether upstream's Pixtral projector class still has the text embedding filtered away
    (the case :func:`plan_conversion` works around; see the module doc)."""
    conversion = load_converter(bin_dir)
    cls: Any = conversion.get_model_class("LlavaForConditionalGeneration", mmproj=True)
    return cls.filter_tensors(("language_model.model.embed_tokens.weight", lambda: None)) is None


def delegate_class(model_class: Any, config: dict[str, Any]) -> Any:
    """The class that does the work when upstream's class only delegates to ``self.impl``.

    Why: ``Mistral3Model`` (Mistral Small 3.x's text model) builds a nested ``Ministral3Model``
    (``Mistral4Model`` for ``model_type`` mistral4) as ``self.impl`` and hands it
    ``prepare_tensors``; the impl indexes the files itself, so the hooks fed to the outer class
    would never run. Planning with the nested class, chosen as ``__init__`` chooses it, is the
    same conversion."""
    if model_class.__name__ != "Mistral3Model" or not hasattr(model_class, "Ministral3Model"):
        return model_class
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if (text or {}).get("model_type") == "mistral4":
        return model_class.Mistral4Model
    return model_class.Ministral3Model


TRANSPOSED_EXPERTS_CLASSES = ("Qwen3VLMoeTextModel",)
"""Upstream classes whose ``modify_tensors`` transposes packed experts, taking them in the
orientation of the Hub's checkpoints (see :func:`upstream_modify`)."""


def upstream_modify(
    model_class: Any, model: Any, data: Any, name: str, bid: int | None
) -> Iterable[Any]:
    """What upstream's ``model_class.modify_tensors`` makes of one tensor, except that packed
    experts stored in transformers' own orientation skip a class that would transpose them.

    Why: ``Qwen3VLMoeTextModel`` takes ``mlp.experts.gate_up_proj`` as the Hub's Qwen3-VL-MoE
    checkpoints store it, ``[E, hidden, 2*ff]`` (``down_proj`` ``[E, ff, hidden]``), and
    transposes both. transformers 5 loads those through a ``Transpose(1, 2, check_dims=True)``
    into parameters of ``[E, 2*ff, hidden]`` / ``[E, hidden, ff]`` and saves them unchanged (the
    reverse operation sees the parameter's own shape and leaves it), so a checkpoint that
    transformers 5 wrote came out transposed twice (``ffn_down_exps`` of the wrong shape, which
    llama.cpp refuses to load). Tensors of the parameters' shape are what the Qwen2-MoE class
    under it converts (``Qwen2MoeModel.modify_tensors``: split ``gate_up_proj`` on its rows,
    ``down_proj`` as it is), so they go there, by the rule transformers itself applies (a
    tensor of the parameter's shape is not transposed): both read the same weights whatever
    the widths, a square ``hidden == 2*ff`` included."""
    klass = next((k for k in model_class.__mro__ if k.__name__ in TRANSPOSED_EXPERTS_CLASSES), None)
    if klass is not None and _in_transformers_orientation(model, name, tuple(data.shape)):
        return list(super(klass, model).modify_tensors(data, name, bid))
    return list(model_class.modify_tensors(model, data, name, bid))


def _in_transformers_orientation(model: Any, name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a packed-experts tensor of transformers' parameter shape
    (``gate_up_proj`` ``[E, 2*ff, hidden]``, ``down_proj`` ``[E, hidden, ff]``)."""
    hparams = model.hparams
    hidden, ff = hparams.get("hidden_size"), hparams.get("moe_intermediate_size")
    if len(shape) != 3 or not isinstance(hidden, int) or not isinstance(ff, int):
        return False
    base = name.removesuffix(".weight")
    if base.endswith("mlp.experts.gate_up_proj"):
        return shape[1:] == (2 * ff, hidden)
    if base.endswith("mlp.experts.down_proj"):
        return shape[1:] == (hidden, ff)
    return False


RENAMED_HPARAMS: dict[str, str] = {"rotary_pct": "partial_rotary_factor"}
"""Config keys upstream's classes read under their transformers-4 name -> transformers 5's."""


def upstream_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """``hparams`` (upstream's ``load_hparams``: transformers' ``AutoConfig(...).to_dict()``) with
    the keys transformers 5 renamed back under the names upstream's classes read.

    Why: ``GPTNeoXModel.set_gguf_parameters`` reads ``hparams["rotary_pct"]``, which
    transformers 5's ``GPTNeoXConfig`` keeps as ``rope_parameters["partial_rotary_factor"]``
    (a checkpoint's own ``rotary_pct`` is moved there on load), so every GPT-NeoX failed with
    ``KeyError: 'rotary_pct'``. The value is the same number under its new name."""
    out = dict(hparams)
    params = out.get("rope_parameters")
    for old, new in RENAMED_HPARAMS.items():
        if old in out:
            continue
        value = out.get(new)
        if value is None and isinstance(params, dict):
            value = params.get(new)
        if value is not None:
            out[old] = value
    return out


def published_layout(root: Path, config: dict[str, Any], names: list[str]) -> dict[str, str]:
    """For a vision-language model, each checkpoint name whose published name differs ->
    that name (``shims.transformers_keys.published_names``: through transformers' own rules,
    so a layout transformers saves reaches upstream's classes as the Hub's does); empty for
    a text model, whose classes read every layout transformers writes."""
    if not config.get("vision_config"):
        return {}
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from service.shims.transformers_keys import published_names

    hf_config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_config)  # type: ignore[no-untyped-call]
    return {k: v for k, v in published_names(model, names).items() if k != v}
