"""The assumptions service.shims.llama_cpp_convert makes about llama.cpp's converter classes
(the ``conversion`` package of the pinned llama-cpp-python sdist), each named in the failure
message so that a new llama.cpp that breaks one says which."""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from service.errors import ToolMissing
from service.shims import llama_cpp_convert as conv
from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION


def test_the_pinned_llama_cpp_is_a_checked_version() -> None:
    assert LLAMA_CPP_PYTHON_VERSION in conv.CHECKED_VERSIONS, (
        "assumption broken: service/shims/llama_cpp.py pins a llama.cpp whose converter the shim "
        "was not checked on; re-run these tests and extend CHECKED_VERSIONS"
    )


def test_text_model_map_is_a_literal_readable_without_importing() -> None:
    names = conv.supported_architectures()
    assert names["LlamaForCausalLM"] == "llama" and names["BertModel"] == "bert", (
        "assumption broken: conversion/__init__.py's TEXT_MODEL_MAP maps HF names to modules"
    )


def test_converter_classes_keep_the_hooks_the_adapter_overrides() -> None:
    module = conv.load_converter()
    base = importlib.import_module("conversion.base")
    cls = module.get_model_class("LlamaForCausalLM")
    assert issubclass(cls, base.ModelBase)
    init = inspect.signature(base.ModelBase.__init__).parameters
    assert list(init)[1:4] == ["dir_model", "ftype", "fname_out"] and "hparams" in init, (
        "assumption broken: ModelBase(dir_model, ftype, fname_out, ..., hparams=...)"
    )
    assert "self.model_tensors = self.index_tensors(" in inspect.getsource(
        base.ModelBase.__init__
    ), "assumption broken: ModelBase.__init__ indexes tensors through self.index_tensors()"
    prepare = inspect.getsource(base.ModelBase.prepare_tensors)
    assert "self.modify_tensors(data_torch, name, bid)" in prepare, (
        "assumption broken: prepare_tensors calls self.modify_tensors(data_torch, name, bid)"
    )
    assert "self.gguf_writer.add_tensor(new_name, data, raw_dtype=data_qtype)" in prepare, (
        "assumption broken: prepare_tensors hands each output to gguf_writer.add_tensor"
    )
    pre = inspect.getsource(base.TextModel.get_vocab_base_pre)
    assert "chkhsh = sha256(str(chktok).encode()).hexdigest()" in pre, (
        "assumption broken: the pre-tokenizer hash is sha256(str(tokenizer.encode(chktxt)))"
    )
    assert 'raise NotImplementedError("BPE pre-tokenizer was not recognized' in pre, (
        "assumption broken: an unknown pre-tokenizer raises NotImplementedError"
    )
    assert hasattr(base.TextModel, "_set_vocab_none") and hasattr(base.TextModel, "set_vocab")


def test_lazy_tensors_cache_their_value_once_evaluated() -> None:
    """Why OneShot releases the graph: evaluation stores the data in the node."""
    conv.load_converter()
    lazy_type = importlib.import_module("conversion.base").LazyTorchTensor
    calls: list[str] = []

    def load(name: str) -> torch.Tensor:
        calls.append(name)
        return torch.ones(2, 3)

    lazy = lazy_type(meta=lazy_type.meta_with_dtype_and_shape(torch.float32, (2, 3)),
                     args=("w",), func=load)  # fmt: skip
    doubled = lazy * 2
    assert calls == [], "assumption broken: building a lazy graph reads nothing"
    once = conv.OneShot(doubled, lazy_type)
    assert once().tolist() == [[2.0] * 3] * 2 and calls == ["w"]
    assert doubled._data is not None, "assumption broken: to_eager caches data in the node"


def test_a_row_slice_of_a_lazy_tensor_is_recognised_as_its_first_rows() -> None:
    """Why the trimmed Gemma embedding streams: ``data[:n]`` records getitem and its key."""
    conv.load_converter()
    lazy_type = importlib.import_module("conversion.base").LazyTorchTensor
    data = lazy_type(meta=lazy_type.meta_with_dtype_and_shape(torch.float32, (10, 4)),
                     args=("w",), func=lambda name: torch.zeros(10, 4))  # fmt: skip
    assert conv.leading_rows(data[:7], data) == 7, (
        "assumption broken: gguf-py's lazy __getitem__ records _func=torch.Tensor.__getitem__ "
        "and _args=(tensor, key)"
    )
    assert conv.leading_rows(data, data) is None
    for other in (data[1:7], data[:7:2], data[:, :2], data[:-1], (data * 2)[:7]):
        assert conv.leading_rows(other, data) is None


def test_one_row_of_a_lazy_tensor_is_recognised_as_that_row() -> None:
    """Why Pixtral's [IMG_BREAK] row is read alone: ``data[i]`` records getitem and its int."""
    conv.load_converter()
    lazy_type = importlib.import_module("conversion.base").LazyTorchTensor
    data = lazy_type(meta=lazy_type.meta_with_dtype_and_shape(torch.float32, (10, 4)),
                     args=("w",), func=lambda name: torch.zeros(10, 4))  # fmt: skip
    assert conv.picked_row(data[7], data) == 7, (
        "assumption broken: gguf-py's lazy __getitem__ records _func=torch.Tensor.__getitem__ "
        "and _args=(tensor, int) for one row"
    )
    for other in (data[:7], data[-1], (data * 2)[7], data[7:8]):
        assert conv.picked_row(other, data) is None


def test_a_row_is_read_alone_with_or_without_read_into() -> None:
    """row_reader gives the row's values whichever way the reader serves it."""
    full = torch.arange(40, dtype=torch.bfloat16).reshape(10, 4)

    class Chunks:
        def tensor_infos(self) -> list[Any]:
            return []

        def aliases(self) -> dict[str, str]:
            return {}

        def read(self, name: str) -> torch.Tensor:
            raise AssertionError("the whole tensor was read for one row")

        def iter_chunks(self, name: str, max_bytes: int) -> Any:
            yield from full.reshape(-1).split(3)

    assert conv.row_reader(Chunks(), "w", 7, 4, full.dtype)().tolist() == [28.0, 29.0, 30.0, 31.0]

    class ReadsInto(Chunks):
        def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
            out.copy_(full.reshape(-1)[start : start + out.numel()])

    assert conv.row_reader(ReadsInto(), "w", 2, 4, full.dtype)().tolist() == [8.0, 9.0, 10.0, 11.0]


def test_upstreams_pixtral_projector_class_still_filters_the_embedding_it_reads() -> None:
    """The shim hands LlavaVisionModel the text embedding that MmprojModel.filter_tensors
    drops, so that it can copy the [IMG_BREAK] row; once upstream keeps it, the workaround in
    plan_conversion is dead code to remove."""
    assert conv.break_row_filtered(), (
        "assumption broken: upstream's Pixtral projector class now keeps "
        "language_model.*embed_tokens.weight; remove keeps_break_row from plan_conversion"
    )
    source = inspect.getsource(
        conv.load_converter().get_model_class("LlavaForConditionalGeneration", mmproj=True)
    )
    assert "img_break_embd = data_torch[self.img_break_tok_id]" in source, (
        "assumption broken: LlavaVisionModel copies [IMG_BREAK]'s row as data[token_id]"
    )


def test_mistral3s_text_class_delegates_to_the_nested_class_the_adapter_plans_with() -> None:
    module = conv.load_converter()
    outer = module.get_model_class("Mistral3ForConditionalGeneration")
    source = inspect.getsource(outer)
    assert "self.impl = Mistral3Model.Ministral3Model(*args, **kwargs)" in source and (
        "self.impl.prepare_tensors()" in source
    ), "assumption broken: Mistral3Model delegates prepare_tensors to a nested Ministral3Model"
    assert conv.delegate_class(outer, {"text_config": {"model_type": "mistral"}}) is (
        outer.Ministral3Model
    )
    assert conv.delegate_class(outer, {"text_config": {"model_type": "mistral4"}}) is (
        outer.Mistral4Model
    )
    llama = module.get_model_class("LlamaForCausalLM")
    assert conv.delegate_class(llama, {}) is llama


def test_the_converter_runs_on_gguf_py_of_its_own_llama_cpp() -> None:
    conv.load_converter()
    import gguf

    assert conv.gguf_py_mismatch() is None
    assert not any(Path(p or ".").name == "gguf-py" for p in sys.path), (
        "assumption broken: conversion/base.py leaves sys.path alone when NO_LOCAL_GGUF is set"
    )
    assert hasattr(gguf, "LazyChunkedTensor"), (
        "the converter uses gguf.LazyChunkedTensor, absent from PyPI's gguf of the same version"
    )


def _lazy(lazy_type: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    return lazy_type(meta=lazy_type.meta_with_dtype_and_shape(dtype, shape), args=(name,),
                     func=lambda n: torch.zeros(shape, dtype=dtype))  # fmt: skip


def test_a_stack_of_lazy_experts_is_recognised_as_their_rows_in_order() -> None:
    """Why a MoE layer's experts stream: ``torch.stack(experts, dim=0)`` records its tensors."""
    conv.load_converter()
    lazy_type = importlib.import_module("conversion.base").LazyTorchTensor
    a, b = (_lazy(lazy_type, n, (4, 2), torch.float32) for n in ("e0", "e1"))
    c = _lazy(lazy_type, "e2", (4, 2), torch.bfloat16)
    leaves = {id(a): "e0", id(b): "e1", id(c): "e2"}
    assert conv.stacked_rows(torch.stack([a, b], dim=0), leaves) == ("e0", "e1"), (
        "assumption broken: gguf-py's lazy __torch_function__ records _func=torch.stack, "
        "_args=(tensors,) and _kwargs={'dim': 0}"
    )
    # upstream's prepare_tensors widens bfloat16 to float32 before modify_tensors stacks it
    prepare = inspect.getsource(importlib.import_module("conversion.base").ModelBase.prepare_tensors)
    assert "data_torch = data_torch.to(torch.float32)" in prepare, (
        "assumption broken: prepare_tensors widens other dtypes with data_torch.to(torch.float32)"
    )
    assert conv.stacked_rows(torch.stack([c.to(torch.float32), a]), leaves) == ("e2", "e0")
    others = (torch.stack([a, b], dim=1), torch.stack([a * 2, b]), torch.cat([a, b]),
              torch.stack([c.view(torch.float16), a]), torch.stack([a.to(torch.float32), b]))
    for other in others:
        assert conv.stacked_rows(other, leaves) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixtral_experts_are_planned_as_their_checkpoint_tensors_not_computed(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from service.checkpoint import open_checkpoint

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    MixtralForCausalLM(config).to(dtype).save_pretrained(tmp_path)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.config is not None
        plan = conv.plan_conversion(tmp_path, ckpt.config, ckpt.reader, "f16", vocab=False)
    experts = {t.name: t for t in plan.tensors if "_exps" in t.name}
    assert len(experts) == 2 * 3
    for bid in range(2):
        for gguf_name, hf_name in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            t = experts[f"blk.{bid}.ffn_{gguf_name}_exps.weight"]
            assert t.compute is None and t.source is None
            assert t.parts == tuple(
                f"model.layers.{bid}.block_sparse_moe.experts.{x}.{hf_name}.weight"
                for x in range(4)
            )


def test_the_converter_refuses_a_gguf_that_is_not_its_llama_cpps(tmp_path: Path) -> None:
    """A llama.cpp whose gguf-py differs from the installed ``gguf`` is refused, not patched in."""
    other = tmp_path / "llama.cpp"
    (other / "bin").mkdir(parents=True)
    (other / "convert" / "conversion").mkdir(parents=True)
    (other / "convert" / "conversion" / "__init__.py").write_text("")
    gguf_py = other / "convert" / "gguf-py" / "gguf"
    shutil.copytree(conv.converter_dir() / "gguf-py" / "gguf", gguf_py)
    constants = gguf_py / "constants.py"
    constants.write_text(constants.read_text() + "\nGGUF_MAGIC_OF_ANOTHER_RELEASE = 1\n")
    mismatch = conv.gguf_py_mismatch(other / "bin")
    assert mismatch is not None and "constants.py" in mismatch
    with pytest.raises(ToolMissing, match="not llama.cpp .*'s gguf-py"):
        conv.load_converter(other / "bin")


def test_a_vlms_text_model_is_named_by_its_text_config_as_upstream_does() -> None:
    """SmolVLM's config names Idefics3ForConditionalGeneration at the top (no text class
    upstream) and VLlama3ForCausalLM in text_config, which upstream's
    get_model_architecture converts as the text model; its projector is the top-level name."""
    from service.shims.llama_cpp_convert import (
        hf_architecture,
        mmproj_architecture,
        supported_architectures,
        supported_mmproj_architectures,
    )

    smolvlm = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "text_config": {"architectures": ["VLlama3ForCausalLM"], "model_type": "llama"},
        "vision_config": {"model_type": "idefics3_vision"},
    }
    assert hf_architecture(smolvlm) == "VLlama3ForCausalLM" in supported_architectures()
    assert mmproj_architecture(smolvlm) == "Idefics3ForConditionalGeneration"
    assert "Idefics3ForConditionalGeneration" in supported_mmproj_architectures()


def test_the_lora_converter_is_the_lora_model_the_adapter_mirrors() -> None:
    """plan_lora_conversion rebuilds upstream's LoraModel (defined under ``__main__``, so not
    importable) from the script's importable parts: each overridden method, the tensor class,
    the adapter keys and the prepare_tensors path that lets ``.lora_a``/``.lora_b`` be typed."""
    import ast

    module = conv.load_lora_converter()
    source = (conv.converter_dir() / conv.LORA_SCRIPT).read_text(encoding="utf-8")
    classes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    lora_model = next((c for c in classes if c.name == "LoraModel"), None)
    assert lora_model is not None, "assumption broken: convert_lora_to_gguf.py defines LoraModel"
    methods = {n.name for n in lora_model.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
    assert methods == set(conv.LORA_MODEL_METHODS), (
        f"assumption broken: LoraModel overrides exactly {sorted(conv.LORA_MODEL_METHODS)}; it "
        f"now overrides {sorted(methods)}: mirror the new ones in plan_lora_conversion"
    )
    for needle in ("gguf.GGUFType.ADAPTER", "gguf.Keys.Adapter.TYPE, \"lora\"",
                   "gguf.Keys.Adapter.LORA_ALPHA, self.lora_alpha",
                   'yield (dest_name + ".lora_a", lora_a)', "get_lora_A_B()"):  # fmt: skip
        assert needle in source, f"assumption broken: LoraModel writes {needle}"
    a, b = torch.randn(4, 32), torch.randn(64, 4)
    lora = module.LoraTorchTensor(a, b)
    permuted = lora.reshape(8, 2, 4, 32).swapaxes(1, 2).reshape(64, 32)
    got_a, got_b = permuted.get_lora_A_B()
    want = (b @ a).reshape(8, 2, 4, 32).swapaxes(1, 2).reshape(64, 32)
    assert torch.allclose(got_b @ got_a, want, atol=1e-5), (
        "assumption broken: LoraTorchTensor follows a q/k row permutation on B"
    )
    base = importlib.import_module("conversion.base")
    prepare = inspect.getsource(base.ModelBase.prepare_tensors)
    assert '".lora_a", ".lora_b"' in prepare, (
        "assumption broken: prepare_tensors stores .lora_a/.lora_b at the file type"
    )


def test_qwen3_vl_moes_class_transposes_experts_and_its_base_takes_transformers_own() -> None:
    """Why upstream_modify steps past Qwen3VLMoeTextModel for experts in transformers' own
    orientation: that class transposes the Hub's [E, in, out]; the Qwen2-MoE class under it
    splits gate_up_proj on its rows ([E, 2*ff, hidden]) and copies down_proj."""
    module = conv.load_converter()
    cls = module.get_model_class("Qwen3VLMoeForConditionalGeneration")
    assert [k.__name__ for k in cls.__mro__ if k.__name__ in conv.TRANSPOSED_EXPERTS_CLASSES] == [
        "Qwen3VLMoeTextModel"
    ], "assumption broken: Qwen3-VL-MoE's text class is (or derives from) Qwen3VLMoeTextModel"
    own = inspect.getsource(cls.modify_tensors)
    assert "data_torch.permute(0, 2, 1)" in own and "data_torch[..., :split_dim]" in own, (
        "assumption broken: Qwen3VLMoeTextModel transposes packed experts as [E, in, out]"
    )
    qwen2moe = importlib.import_module("conversion.qwen").Qwen2MoeModel
    base = inspect.getsource(qwen2moe.modify_tensors)
    assert "data_torch[..., :n_ff, :]" in base, (
        "assumption broken: Qwen2MoeModel splits a packed gate_up_proj [E, 2*ff, hidden] on rows"
    )


def test_qwen3_vl_moe_experts_saved_by_transformers_5_plan_as_llama_cpp_loads_them() -> None:
    """transformers 5 writes the packed experts as its parameters ([E, 2*ff, hidden],
    [E, hidden, ff]); planned through upstream_modify they come out in the shapes llama.cpp's
    ffn_*_exps take, down_proj a plain copy streamed from the checkpoint."""
    from service.checkpoint import open_checkpoint
    from tests.fixtures.vlm import cached_qwen3vl_moe

    root = cached_qwen3vl_moe()
    with open_checkpoint(root) as ckpt:
        assert ckpt.config is not None
        text = ckpt.config["text_config"]
        name = "model.language_model.layers.0.mlp.experts."
        shapes = {i.name: tuple(i.shape) for i in ckpt.reader.tensor_infos()}
        experts, hidden, ff = text["num_local_experts"], text["hidden_size"], text[
            "moe_intermediate_size"]  # fmt: skip
        assert shapes[name + "gate_up_proj"] == (experts, 2 * ff, hidden)
        assert shapes[name + "down_proj"] == (experts, hidden, ff)
        plan = conv.plan_conversion(root, ckpt.config, ckpt.reader, "f16", vocab=False)
    tensors = {t.name: t for t in plan.tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (experts, ff, hidden)
    assert tensors["blk.0.ffn_up_exps.weight"].shape == (experts, ff, hidden)
    down = tensors["blk.0.ffn_down_exps.weight"]
    assert down.shape == (experts, hidden, ff) and down.source == name + "down_proj"


def test_gemma_4s_projector_class_does_not_drop_a_tied_heads_name() -> None:
    """Why plan_conversion hands a projector class no alias: Gemma 4's keeps ``lm_head.weight``
    (MmprojModel.filter_tensors drops language_model.* only) and then cannot map it; the alias
    of a tied embedding would be that name."""
    cls = conv.load_converter().get_model_class("Gemma4ForConditionalGeneration", mmproj=True)
    assert cls.filter_tensors(("lm_head.weight", lambda: None)) is not None, (
        "upstream's projector classes now drop lm_head.*: the mmproj guard on aliases in "
        "plan_conversion is no longer needed for them"
    )


@pytest.mark.parametrize(
    ("family", "arch"),
    [("gemma", "GemmaForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
     ("internlm3", "InternLM3ForCausalLM"), ("phi3", "Phi3ForCausalLM")],
)  # fmt: skip
def test_sentencepiece_classes_read_tokenizer_model_and_nothing_else(
    family: str, arch: str, tmp_path: Path
) -> None:
    """``vocab.SENTENCEPIECE_ONLY``: upstream's class for ``arch`` writes the vocabulary from
    ``tokenizer.model`` and fails without it although ``tokenizer.json`` is there (the
    service refuses such a checkpoint at submission, naming the file)."""
    from service.checkpoint import open_checkpoint
    from service.errors import UnsupportedTokenizer
    from service.shims.llama_cpp_convert.vocab import SENTENCEPIECE_ONLY, missing_sentencepiece
    from tests.fixtures.families import family_checkpoint
    from tests.fixtures.models import copy_tree

    source = family_checkpoint(family)
    without = copy_tree(source, tmp_path / "ckpt")
    (without / "tokenizer.model").unlink()
    assert missing_sentencepiece(arch, without) is not None
    for root, fails in ((source, False), (without, True)):
        with open_checkpoint(root) as ckpt:
            assert ckpt.config is not None and ckpt.config["architectures"] == [arch]
            if not fails:
                plan = conv.plan_conversion(root, ckpt.config, ckpt.reader, "f16")
                assert plan.model_class == SENTENCEPIECE_ONLY[arch]
                continue
            with pytest.raises(Exception) as failed:
                conv.plan_conversion(root, ckpt.config, ckpt.reader, "f16")
        assert "tokenizer.model" in str(failed.value), (
            f"upstream's {SENTENCEPIECE_ONLY[arch]} no longer fails on a checkpoint without "
            f"tokenizer.model ({failed.value!r}): check vocab.SENTENCEPIECE_ONLY"
        )
        assert isinstance(failed.value, UnsupportedTokenizer), failed.value


def test_gpt_neox_reads_rotary_pct_which_transformers_5_renamed(tmp_path: Path) -> None:
    """``classes.upstream_hparams``: ``GPTNeoXModel`` reads ``hparams["rotary_pct"]``, which
    transformers 5's config keeps as ``rope_parameters["partial_rotary_factor"]``."""
    from transformers import AutoConfig

    from service.checkpoint import open_checkpoint
    from tests.fixtures.families import family_checkpoint

    source = family_checkpoint("gpt_neox")
    loaded = AutoConfig.from_pretrained(source).to_dict()
    assert "rotary_pct" not in loaded, "transformers has rotary_pct again: drop the renaming"
    assert conv.upstream_hparams(loaded)["rotary_pct"] == 0.25
    with open_checkpoint(source) as ckpt:
        assert ckpt.config is not None
        plan = conv.plan_conversion(source, ckpt.config, ckpt.reader, "f16", vocab=False)
    rope = dict(plan.metadata)["gptneox.rope.dimension_count"].value
    assert rope == int(0.25 * 64 // 4)


def test_a_tied_head_upstream_has_no_tensor_for_is_not_handed_over(tmp_path: Path) -> None:
    """Command-R has no output tensor (llama.cpp uses the embedding): upstream's class cannot
    map the reader's alias ``lm_head.weight`` of the tied embedding, which it never sees in the
    files, so it is left out rather than failing the conversion."""
    from service.checkpoint import open_checkpoint
    from tests.fixtures.families import family_checkpoint

    source = family_checkpoint("cohere")
    with open_checkpoint(source) as ckpt:
        assert ckpt.config is not None
        assert "lm_head.weight" in ckpt.reader.aliases()
        plan = conv.plan_conversion(source, ckpt.config, ckpt.reader, "f16", vocab=False)
    names = {t.name for t in plan.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names
