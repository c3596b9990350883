"""The assumptions service.adapters.llama_cpp_convert makes about llama.cpp's converter classes
(the ``conversion`` package of the pinned llama-cpp-python sdist), each named in the failure
message so that a new llama.cpp that breaks one says which."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

from service.adapters import llama_cpp_convert as conv
from service.llama_cpp import LLAMA_CPP_PYTHON_VERSION


def test_the_pinned_llama_cpp_is_a_checked_version() -> None:
    assert LLAMA_CPP_PYTHON_VERSION in conv.CHECKED_VERSIONS, (
        "assumption broken: service/llama_cpp.py pins a llama.cpp whose converter the adapter "
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


def test_the_converter_runs_on_gguf_py_of_its_own_llama_cpp() -> None:
    conv.load_converter()
    import gguf

    root = conv.converter_dir() / "gguf-py"
    assert Path(str(gguf.__file__)).resolve().is_relative_to(root.resolve())
    assert hasattr(gguf, "LazyChunkedTensor"), (
        "the converter uses gguf.LazyChunkedTensor, absent from PyPI's gguf of the same version"
    )
