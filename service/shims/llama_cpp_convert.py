"""llama.cpp's own HF -> GGUF converter classes, used as a library fed by the service's readers.

Why: ``convert_hf_to_gguf``'s ``conversion`` package knows ~250 architectures (tensor names, q/k
permutations, expert stacking, norm offsets, hyperparameter keys) and ~90 BPE pre-tokenizer
hashes. Re-deriving those tables by hand is how a converter falls behind, so the GGUF exporter
asks upstream's class for the model (``ModelBase.from_model_architecture``) what it would write,
and writes it itself (bounded memory, progress, cancel, sha256 while writing).

What is used of upstream's internals (checked on :data:`CHECKED_VERSIONS`, pinned by
``service.shims.llama_cpp.LLAMA_CPP_PYTHON_VERSION``; ``tests/integration/shims/test_llama_cpp_convert.py``
names each assumption):

* ``conversion/__init__.py``'s ``TEXT_MODEL_MAP`` literal (read with ``ast``: the API process
  answers "which architectures" without importing torch) and ``get_model_class``;
* ``ModelBase.__init__(dir_model, ftype, fname_out, ...)`` calling ``self.index_tensors()``, which a
  subclass overrides to hand out lazy tensors read by *our* reader instead of its file loading;
* ``prepare_tensors()`` calling ``self.modify_tensors(data, name, bid)`` and putting every output in
  ``self.gguf_writer.tensors[0]`` as ``TensorInfo(shape, dtype, nbytes, tensor)``;
* ``prepare_metadata(vocab_only=False)`` filling ``self.gguf_writer.kv_data[0]`` (set_gguf_parameters
  and set_vocab);
* ``get_vocab_base_pre(tokenizer)`` calling ``tokenizer.encode(chktxt)`` once, hashing ``str()`` of the
  ids with sha256 and raising ``NotImplementedError`` for an unknown hash;
* ``LazyTorchTensor(meta=..., args=..., func=...)`` and ``LazyTorchTensor.to_eager``, whose evaluation
  caches data in the graph (so a tensor's graph is evaluated once, then dropped);
* a lazy operation recording its function and arguments in ``_func``/``_args``/``_kwargs``
  (``data[:n]`` as ``torch.Tensor.__getitem__``, a MoE layer's ``torch.stack(experts, dim=0)``
  as ``torch.stack``), read by :func:`leading_rows` and :func:`stacked_rows`;
* gguf-py's lazy ``data[i]`` (an int key) recording the same, read by :func:`picked_row` (LLaVA's
  Pixtral class copies the ``[IMG_BREAK]`` row of the text embedding into the projector);
* ``MmprojModel.filter_tensors`` dropping every ``language_model.*`` tensor, the text embedding
  of a Hugging Face Pixtral/Mistral 3 checkpoint included, before ``LlavaVisionModel`` can copy
  its ``[IMG_BREAK]`` row (``v.token_embd.img_break``, which llama-mtmd-cli requires of a
  Pixtral projector: without it the file does not load); :func:`plan_conversion` hands that
  one tensor to the class, which writes only the row (:func:`break_row_filtered` is the test's
  probe: when it turns False upstream has fixed it);
* ``MmprojModel.filter_tensors`` not dropping ``lm_head.*`` (Gemma 4's projector class then fails
  to map it), so a projector class is handed the stored tensors only, never the reader's alias
  of a tied embedding;
* ``conversion/mistral3.py``'s ``Mistral3Model`` delegating everything to ``self.impl``, an
  instance of its nested ``Ministral3Model`` (``Mistral4Model`` for ``model_type`` mistral4),
  which :func:`delegate_class` plans with instead;
* ``conversion/qwen3vl.py``'s ``Qwen3VLMoeTextModel.modify_tensors`` transposing packed experts
  (``mlp.experts.gate_up_proj`` / ``down_proj``) it takes in the Hub's ``[E, in, out]``
  orientation, and handing any other tensor to the Qwen2-MoE class under it, which takes packed
  experts in transformers' own ``[E, out, in]``: :func:`upstream_modify` sends experts stored in
  transformers' orientation past the first (:data:`TRANSPOSED_EXPERTS_CLASSES`);
* ``conversion/base.py`` leaving ``sys.path`` alone when ``NO_LOCAL_GGUF`` is set;
* ``convert_lora_to_gguf.py`` importable as a module (its script body runs under ``__main__``),
  its ``LoraTorchTensor(A, B)`` following the base class's tensor transforms, and its
  ``LoraModel`` overriding exactly :data:`LORA_MODEL_METHODS`, which
  :func:`plan_lora_conversion` mirrors (the class itself is defined under ``__main__``).

The converter needs the gguf-py of the same llama.cpp, which is newer than PyPI's ``gguf`` of the
same version string. It is the venv's one ``gguf`` package (``make install``, the image and CI
install it with ``scripts/install_gguf_py.sh``), so the writer, the planner and the offload
store's GGML blocks agree on every enum and constant; :func:`load_converter` refuses to run on
any other ``gguf`` rather than swap modules under the process.

Why one module of over 450 lines: the style keeps every use of a library's internals in one
shim module per library, next to the list of assumptions above, so an upgrade of llama.cpp is
checked against one file and one test module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from hashlib import sha256
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import ToolMissing, UnsupportedExport, UnsupportedTokenizer
from service.shims.llama_cpp import LLAMA_CPP_PYTHON_VERSION, default_bin_dir

if TYPE_CHECKING:
    import numpy as np
    import torch


class ConverterReader(Protocol):
    """What the shim needs of a checkpoint reader (service.checkpoint.base.WeightReader)."""

    def tensor_infos(self) -> list[Any]: ...

    def aliases(self) -> dict[str, str]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]: ...

log = logging.getLogger(__name__)

CHECKED_VERSIONS = ("0.3.36",)
"""llama-cpp-python sdists whose vendored converter this shim was checked against."""

FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
"""Output types upstream's converter plans (``--outtype``); anything else is mapped by the caller."""


def converter_dir(bin_dir: Path | None = None) -> Path:
    """``<cache>/llama.cpp/<version>/convert`` beside the tools (scripts/build_llama_cpp.sh)."""
    if LLAMA_CPP_PYTHON_VERSION not in CHECKED_VERSIONS:
        raise ToolMissing(
            f"llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s converter is not one this shim was checked "
            f"on ({', '.join(CHECKED_VERSIONS)}): check service/shims/llama_cpp_convert.py"
        )
    path = (bin_dir or default_bin_dir()).parent / "convert"
    if not (path / "conversion" / "__init__.py").is_file():
        raise ToolMissing(
            f"llama.cpp's converter classes not found at {path}; run `make llama-cpp` "
            "(scripts/build_llama_cpp.sh keeps them beside the tools)"
        )
    return path


@lru_cache(maxsize=8)
def _text_model_map(init_file: Path, literal: str = "TEXT_MODEL_MAP") -> dict[str, str]:
    tree = ast.parse(init_file.read_text(encoding="utf-8"))
    for node in tree.body:
        target: ast.expr | None = None
        value_node: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value_node = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value_node = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == literal and value_node:
            value = ast.literal_eval(value_node)
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in value.items()}
    raise ToolMissing(f"{init_file} has no {literal} literal: not the converter checked here")


def supported_architectures(bin_dir: Path | None = None) -> dict[str, str]:
    """Hugging Face architecture name -> upstream module, read without importing the converter."""
    return _text_model_map(converter_dir(bin_dir) / "conversion" / "__init__.py")


def supported_mmproj_architectures(bin_dir: Path | None = None) -> dict[str, str]:
    """Architecture name -> upstream module of the multimodal projectors upstream writes
    (``MMPROJ_MODEL_MAP``, what ``convert_hf_to_gguf.py --mmproj`` dispatches on)."""
    return _text_model_map(converter_dir(bin_dir) / "conversion" / "__init__.py", "MMPROJ_MODEL_MAP")


def mmproj_architecture(config: dict[str, Any]) -> str | None:
    """The architecture ``--mmproj`` dispatches on (``vision_config.architectures`` first, as
    upstream's ``get_model_architecture``), or None for a config without a vision tower."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    names = vision.get("architectures") or config.get("architectures") or []
    return str(names[0]) if names else None


def _import_package(name: str, directory: Path) -> ModuleType:
    """Import the package ``directory`` as ``name`` without putting its parent on ``sys.path``.

    Why not ``sys.path``: the converter's directory also holds ``gguf-py``, whose own directory
    holds ``tests`` and ``examples`` packages, and ``sys.path`` is inherited by every process
    this one starts (multiprocessing children rebuild it from the parent's)."""
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    if spec is None or spec.loader is None:
        raise ToolMissing(f"llama.cpp's converter has no package {name!r} in {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``values`` set in ``os.environ`` for the duration, the previous values restored."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gguf_py_mismatch(bin_dir: Path | None = None) -> str | None:
    """Why the importable ``gguf`` is not the pinned llama.cpp's gguf-py, or None when it is
    (every module of llama.cpp's ``gguf-py/gguf`` installed, byte for byte)."""
    import gguf

    pinned = converter_dir(bin_dir) / "gguf-py" / "gguf"
    installed = Path(str(gguf.__file__)).parent
    for source in sorted(pinned.rglob("*.py")):
        rel = source.relative_to(pinned)
        target = installed / rel
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            return f"{installed / rel} is not {source}"
    return None


def load_converter(bin_dir: Path | None = None) -> ModuleType:
    """Import upstream's ``conversion`` package; :class:`ToolMissing` unless the ``gguf`` it
    imports is the gguf-py of the same llama.cpp."""
    root = converter_dir(bin_dir).resolve()
    mismatch = gguf_py_mismatch(bin_dir)
    if mismatch is not None:
        raise ToolMissing(
            f"the installed gguf package is not llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s gguf-py "
            f"({mismatch}); install it with `make install` (scripts/install_gguf_py.sh)"
        )
    loaded = sys.modules.get("conversion")
    if loaded is None:
        # conversion/base.py puts its gguf-py on sys.path at import (a second gguf, and gguf-py's
        # ``tests`` package, for this process and its children) unless NO_LOCAL_GGUF is set.
        with _environ(NO_LOCAL_GGUF="1"):
            loaded = _import_package("conversion", root / "conversion")
            importlib.import_module("conversion.base")
    if not Path(str(loaded.__file__)).resolve().is_relative_to(root):
        raise ToolMissing(f"another 'conversion' package is imported: {loaded.__file__}")
    # upstream logs every tensor at INFO; keep the job log to what the service says
    logging.getLogger("hf-to-gguf").setLevel(logging.WARNING)
    return loaded


# --- one conversion, planned --------------------------------------------------------------------


class OneShot:
    """A lazy upstream tensor evaluated at most once, then released.

    Upstream's lazy graph caches every intermediate result in its nodes once evaluated, so holding
    it after use would keep the tensor alive; the caller plans again to evaluate it a second time.
    """

    def __init__(self, tensor: Any, lazy_type: Any) -> None:
        self._tensor: Any = tensor
        self._lazy_type = lazy_type

    def __call__(self) -> np.ndarray:
        import numpy as np
        import torch

        tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise RuntimeError("an upstream tensor is evaluated once per plan; plan again")
        if isinstance(tensor, self._lazy_type):
            tensor = self._lazy_type.to_eager(tensor)
        out = np.ascontiguousarray(tensor.to(torch.float32).numpy())
        del tensor
        return out


def leading_rows(tensor: Any, data: Any) -> int | None:
    """``n`` when ``tensor`` is upstream's lazy ``data[:n]``, else None.

    Why: Gemma's class trims the embedding's padded vocabulary rows this way; evaluated through
    the lazy graph that is the whole embedding in float32 at once (262144 x 640 on the 270M,
    262144 x 5376 on the 27B). The first ``n`` rows of a checkpoint tensor are read as such, in
    row blocks, like any copied tensor. Relies on gguf-py's lazy ``__getitem__`` recording
    ``_func`` (``torch.Tensor.__getitem__``) and ``_args`` (``(data, key)``): a test names it.
    """
    import torch

    if getattr(tensor, "_func", None) is not torch.Tensor.__getitem__:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[0] is not data or not isinstance(args[1], slice):
        return None
    key: slice = args[1]
    if key.start not in (None, 0) or key.step not in (None, 1) or not isinstance(key.stop, int):
        return None
    return key.stop if key.stop >= 0 else None


def picked_row(tensor: Any, data: Any) -> int | None:
    """``i`` when ``tensor`` is upstream's lazy ``data[i]`` (one row), else None.

    Why: LLaVA's Pixtral class copies the ``[IMG_BREAK]`` row of the text embedding into the
    projector as ``data[token_id]``; evaluated through the lazy graph that is the whole
    embedding in float32 (131072 x 5120 x 4 = 2.7 GB on Pixtral 12B) for one row. The row is
    read alone instead (:func:`row_reader`). Relies on the same recording as
    :func:`leading_rows`, with an int key: a test names it."""
    import torch

    if getattr(tensor, "_func", None) is not torch.Tensor.__getitem__:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[0] is not data or type(args[1]) is not int:
        return None
    return args[1] if args[1] >= 0 else None


def row_reader(
    reader: ConverterReader, name: str, index: int, width: int, dtype: torch.dtype
) -> Callable[[], np.ndarray]:
    """Float32 values of row ``index`` (``width`` elements) of the stored tensor ``name`` (of
    ``dtype``), read without the rest of the tensor: ``read_into`` where the reader has it,
    else its chunks up to the row (bounded by the chunk size, never the whole tensor)."""

    def compute() -> np.ndarray:
        import numpy as np
        import torch

        start = index * width
        read_into = getattr(reader, "read_into", None)
        if read_into is not None:
            row = torch.empty(width, dtype=dtype)
            read_into(name, start, row)
        else:
            pieces, seen = [], 0
            for chunk in reader.iter_chunks(name, 16 << 20):
                flat = chunk.reshape(-1)
                if seen + flat.numel() > start:
                    pieces.append(flat[max(0, start - seen) : start + width - seen].clone())
                seen += flat.numel()
                if seen >= start + width:
                    break
            row = torch.cat(pieces)
        return np.ascontiguousarray(row.to(torch.float32).numpy())

    return compute


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


def stacked_rows(tensor: Any, leaves: dict[int, str]) -> tuple[str, ...] | None:
    """The checkpoint tensors, in order, when ``tensor`` is upstream's lazy
    ``torch.stack([...], dim=0)`` of tensors it was given unchanged (``leaves``: id of each lazy
    tensor handed to upstream -> its checkpoint name), else None.

    Why: a MoE layer's converter class (Mixtral's and Qwen2-MoE's ``modify_tensors``) stacks
    every expert of the layer into one 3-D tensor; evaluated through the lazy graph that is all
    of the layer's experts in float32 at once (8 x 14336 x 4096 x 4 = 1.9 GB per projection on
    Mixtral 8x7B). Stacked on the first dimension, the result's rows are the experts' rows one
    expert after the other: each is read as a copied tensor, in row blocks. Relies on gguf-py's
    lazy ``__torch_function__`` recording ``_func`` (``torch.stack``), ``_args``
    (``(tensors,)``) and ``_kwargs`` (``{"dim": 0}``): a test names it.
    """
    import torch

    if getattr(tensor, "_func", None) is not torch.stack:
        return None
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    kwargs: dict[str, Any] = dict(getattr(tensor, "_kwargs", {}) or {})
    if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if dim != 0 or len(args) > 2 or set(kwargs) - {"dim"}:
        return None
    names = [_leaf_name(part, leaves) for part in args[0]]
    if any(name is None for name in names):
        return None
    return tuple(str(name) for name in names)


def _leaf_name(tensor: Any, leaves: dict[int, str]) -> str | None:
    """The checkpoint name of a lazy tensor handed to upstream, seen through upstream's
    widening to float32 (``prepare_tensors`` does ``data_torch.to(torch.float32)`` to every
    tensor that is neither float16 nor float32: a bfloat16 expert arrives as that, values
    unchanged). gguf-py records a method call as a lambda over ``(tensor, *args)``, so the cast
    is recognised by what it is: one float32 argument, the leaf's shape, a float32 result
    from a narrower dtype (a ``view`` of another width would change the shape)."""
    import torch

    name = leaves.get(id(tensor))
    if name is not None:
        return name
    args: tuple[Any, ...] = tuple(getattr(tensor, "_args", ()))
    if len(args) != 2 or args[1] is not torch.float32 or getattr(tensor, "_kwargs", None):
        return None
    leaf, meta = args[0], getattr(tensor, "_meta", None)
    name = leaves.get(id(leaf))
    leaf_meta = getattr(leaf, "_meta", None)
    if name is None or meta is None or leaf_meta is None:
        return None
    widened = meta.dtype == torch.float32 and leaf_meta.dtype.itemsize < 4
    return name if widened and tuple(meta.shape) == tuple(leaf_meta.shape) else None


def _head_of(source: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is the source's shape or its first rows (see :func:`leading_rows`)."""
    return shape == source or (
        len(shape) == len(source) >= 1 and shape[1:] == source[1:] and shape[0] <= source[0]
    )


@dataclass(frozen=True)
class ConvertedTensor:
    """One tensor of the GGUF upstream's class would write, with where its values come from."""

    name: str
    shape: tuple[int, ...]
    """Row-major (torch) order."""
    ggml_type: int
    nbytes: int
    source: str | None
    """The checkpoint tensor it is a plain copy of (values unchanged; ``shape`` may keep only
    its first rows), else None."""
    compute: Callable[[], np.ndarray] | None
    """Float32 values of a tensor upstream transforms (permutes, offsets): one shot."""
    parts: tuple[str, ...] = ()
    """The checkpoint tensors whose rows, one after the other, are this tensor's (a MoE
    layer's experts stacked on a new first dimension); ``source`` and ``compute`` are None."""


@dataclass
class Conversion:
    """What upstream's class for this checkpoint would write, with no weight read."""

    hf_architecture: str
    arch_name: str
    """GGUF ``general.architecture`` (``llama``, ``gemma3``...)."""
    model_class: str
    tensors: list[ConvertedTensor]
    metadata: list[tuple[str, Any]] = field(default_factory=list)
    """``gguf_writer.kv_data[0]`` items: key -> ``GGUFValue``, in upstream's order."""
    unused: list[str] = field(default_factory=list)
    """Checkpoint tensors upstream writes nothing for."""
    pre_tokenizer_hash: str | None = None
    pre_tokenizer_fallback: str | None = None
    """Set when the hash was unknown and the job accepted this fallback."""
    no_vocab_reason: str | None = None
    """Why ``tokenizer.ggml.model`` is ``none`` (no tokenizer files, or one llama.cpp cannot write)."""


class _Inexpressible(Exception):
    """The tokenizer is not one llama.cpp's vocabulary writers can express (word-level...)."""


def _tokenizer_json_model(root: Path) -> str | None:
    import json

    try:
        data = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return str(model.get("type")) if isinstance(model, dict) else None


class _RecordingTokenizer:
    """Passes everything to the tokenizer and keeps what ``encode`` returned first."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.first: Any = None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        ids = self._tokenizer.encode(*args, **kwargs)
        if self.first is None:
            self.first = ids
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


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


def plan_conversion(
    root: Path,
    config: dict[str, Any],
    reader: ConverterReader,
    ftype: str,
    *,
    bin_dir: Path | None = None,
    metadata: bool = True,
    vocab: bool = True,
    pre_tokenizer_fallback: str | None = None,
    mmproj: bool = False,
) -> Conversion:
    """Run upstream's class for ``root`` on metadata only: names, shapes, types, KV, vocabulary.

    Weights are read only when a :class:`ConvertedTensor`'s ``compute`` is called. ``vocab=False``
    writes ``tokenizer.ggml.model = none`` (a checkpoint without tokenizer files). ``mmproj``
    plans the multimodal projector instead of the text model: upstream's ``MmprojModel``
    subclass for the architecture (``get_model_class(arch, mmproj=True)``, what
    ``convert_hf_to_gguf.py --mmproj`` runs), which keeps the vision tower and projector
    tensors and writes the ``clip.*`` keys; it has no vocabulary.
    """
    conversion = load_converter(bin_dir)
    import gguf
    import torch

    base_mod = importlib.import_module("conversion.base")
    lazy_type: Any = base_mod.LazyTorchTensor
    arch = (mmproj_architecture(config) if mmproj else None) or hf_architecture(config)
    try:
        model_class: Any = conversion.get_model_class(arch, mmproj=mmproj)
    except NotImplementedError:
        what = "a multimodal projector for" if mmproj else ""
        raise UnsupportedExport(f"llama.cpp's converter does not support {what} {arch}") from None
    model_class = delegate_class(model_class, config)

    infos = {info.name: info for info in reader.tensor_infos()}
    # The reader's aliases name a tied text embedding's other half (``lm_head.weight``), which a
    # text class may need; a projector class is handed the stored tensors only, as upstream
    # reads them from the files: MmprojModel.filter_tensors drops ``language_model.*`` but not
    # ``lm_head.*``, and Gemma 4's projector class (tied embeddings) failed to map the alias.
    for alias, canonical in ({} if mmproj else reader.aliases()).items():
        if alias not in infos and canonical in infos:
            infos[alias] = infos[canonical]
    renamed: dict[str, str] = {}
    produced: dict[str, tuple[str, bool, Any]] = {}
    leaves: dict[int, str] = {}
    """id of every lazy tensor handed to upstream -> its checkpoint name (kept alive in
    ``handed``, so that no id is reused while planning)."""
    handed: list[Any] = []
    stacked: dict[str, tuple[str, ...]] = {}
    picked: dict[str, int] = {}
    seen: set[str] = set()
    unknown_hash: list[str] = []

    def lazy(name: str) -> Any:
        info = infos[name]
        leaf = lazy_type(
            meta=lazy_type.meta_with_dtype_and_shape(info.dtype, tuple(info.shape)),
            args=(name,),
            func=reader.read,
        )
        leaves[id(leaf)] = name
        handed.append(leaf)
        return leaf

    keeps_break_row = mmproj and hasattr(model_class, "img_break_tok_id")

    def index_tensors(self: Any, remote_hf_model_id: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in infos:
            item = self.filter_tensors((name, lambda n=name: lazy(n)))
            if item is None and keeps_break_row and name.endswith("embed_tokens.weight"):
                # see break_row_filtered: upstream's Pixtral class reads [IMG_BREAK]'s row of
                # the text embedding, which MmprojModel.filter_tensors drops first
                item = (name.replace("language_model.", ""), lambda n=name: lazy(n))
            if item:
                renamed[item[0]] = name
                out[item[0]] = item[1]
        return out

    def modify_tensors(self: Any, data: Any, name: str, bid: int | None) -> Iterable[Any]:
        seen.add(name)
        outputs = list(upstream_modify(model_class, self, data, name, bid))
        for new_name, tensor in outputs:
            copied = tensor is data or leading_rows(tensor, data) is not None
            produced[new_name] = (renamed.get(name, name), copied and name in renamed, tensor)
            parts = stacked_rows(tensor, leaves)
            if parts is not None:
                stacked[new_name] = parts
            row = picked_row(tensor, data) if name in renamed else None
            if row is not None:
                picked[new_name] = row
        return outputs

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        recorder = _RecordingTokenizer(tokenizer)
        try:
            return str(model_class.get_vocab_base_pre(self, recorder))
        except NotImplementedError as exc:
            if "pre-tokenizer" not in str(exc) or recorder.first is None:
                raise
            kind = _tokenizer_json_model(root)
            if kind not in (None, "BPE"):
                # upstream tried its byte-level BPE writer last, on a tokenizer that is not one
                raise _Inexpressible(f"llama.cpp cannot write a {kind} tokenizer") from None
            digest = sha256(str(recorder.first).encode()).hexdigest()
            unknown_hash.append(digest)
            if pre_tokenizer_fallback is not None:
                return pre_tokenizer_fallback
            raise UnsupportedTokenizer(
                f"the tokenizer's BPE pre-tokenizer (hash {digest}) is unknown to llama.cpp "
                f"{LLAMA_CPP_PYTHON_VERSION}: llama.cpp would split text differently from the "
                "Hugging Face tokenizer. Use a llama.cpp that knows it, or accept llama.cpp's "
                'generic splitting with "pre_tokenizer_fallback": "default" in the GGUF export'
            ) from None

    no_vocab: list[str] = [] if vocab else ["the checkpoint has no tokenizer files"]

    def set_vocab(self: Any) -> None:
        if not no_vocab:
            try:
                model_class.set_vocab(self)
                return
            except _Inexpressible as exc:
                no_vocab.append(str(exc))
        kv = self.gguf_writer.kv_data[0]
        for key in [k for k in kv if k.startswith("tokenizer.")]:
            del kv[key]  # whatever a failed writer added before it gave up
        self._set_vocab_none()

    overrides: dict[str, Any] = {
        "model_arch": model_class.model_arch,
        "index_tensors": index_tensors,
        "modify_tensors": modify_tensors,
    }
    if not mmproj:  # a projector has no vocabulary: upstream's MmprojModel writes none
        overrides |= {"get_vocab_base_pre": get_vocab_base_pre, "set_vocab": set_vocab}
    fed = type(f"Fed{model_class.__name__}", (model_class,), overrides)
    work = Path(root)
    try:
        hparams = dict(model_class.load_hparams(work, False))
        hparams["architectures"] = hparams.get("architectures") or [arch]
        if "quantization_config" not in config:
            # The readers handled it (FP8 dequantized, a contradicted config ignored): upstream
            # must not dequantize again, or refuse a method whose tensors it never sees.
            hparams.pop("quantization_config", None)
        model = fed(
            work,
            gguf.LlamaFileType[FTYPES[ftype]],
            work / "model.gguf",
            eager=False,
            hparams=hparams,
        )
        model.prepare_tensors()
        if metadata:
            model.prepare_metadata(vocab_only=False)
    except (UnsupportedTokenizer, UnsupportedExport):
        raise
    except (KeyError, ValueError, AssertionError, NotImplementedError, TypeError) as exc:
        raise UnsupportedExport(
            f"llama.cpp's converter ({model_class.__name__}) cannot convert this checkpoint: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

    tensors: list[ConvertedTensor] = []
    for name, info in model.gguf_writer.tensors[0].items():
        origin, plain, tensor = produced[name]
        qtype = int(info.dtype)
        shape = tuple(int(d) for d in tensor.shape)
        if plain and _head_of(tuple(infos[origin].shape), shape):
            tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), origin, None))
        elif name in picked and len(shape) == 1 and tuple(infos[origin].shape)[1:] == shape:
            stored = reader.aliases().get(origin, origin)
            compute = row_reader(reader, stored, picked[name], shape[0], infos[origin].dtype)
            tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), None, compute))
        elif name in stacked and all(
            tuple(infos[p].shape) == shape[1:] for p in stacked[name]
        ) and len(stacked[name]) == shape[0]:
            tensors.append(
                ConvertedTensor(name, shape, qtype, int(info.nbytes), None, None, stacked[name])
            )
        else:
            if not isinstance(tensor, (lazy_type, torch.Tensor)):
                raise UnsupportedExport(f"{name}: upstream made a {type(tensor).__name__}")
            compute = OneShot(tensor, lazy_type)
            tensors.append(ConvertedTensor(name, shape, qtype, int(info.nbytes), None, compute))
    model.gguf_writer.tensors.clear()  # its lazy graphs would keep evaluated tensors alive
    produced.clear()
    stacked.clear()
    picked.clear()
    leaves.clear()
    handed.clear()
    kv = list(model.gguf_writer.kv_data[0].items()) if metadata else []
    return Conversion(
        hf_architecture=arch,
        arch_name=str(gguf.MODEL_ARCH_NAMES[model_class.model_arch]),
        model_class=model_class.__name__,
        tensors=tensors,
        metadata=kv,
        unused=sorted(renamed[n] for n in renamed if n not in seen),
        pre_tokenizer_hash=unknown_hash[0] if unknown_hash else None,
        pre_tokenizer_fallback=pre_tokenizer_fallback if unknown_hash else None,
        no_vocab_reason=no_vocab[0] if no_vocab else None,
    )


# --- a PEFT LoRA adapter, as convert_lora_to_gguf.py writes it ---------------------------------

LORA_SCRIPT = "convert_lora_to_gguf.py"
LORA_MODEL_METHODS = (
    "set_vocab", "set_type", "set_gguf_parameters", "generate_extra_tensors", "get_tensors",
    "modify_tensors",
)  # fmt: skip
"""What upstream's ``LoraModel`` (a class defined inside the script's ``__main__`` block, so it
cannot be imported) overrides of the base model's class; :func:`plan_lora_conversion` does the
same in the same way, and a test fails when upstream's class overrides anything else."""


def load_lora_converter(bin_dir: Path | None = None) -> ModuleType:
    """Import upstream's ``convert_lora_to_gguf.py`` as a module (its ``LoraTorchTensor``, the
    lazy ``B @ A`` that follows upstream's tensor transforms); its script body runs only as
    ``__main__``. Needs :func:`load_converter`'s ``conversion`` package, which it imports."""
    load_converter(bin_dir)
    loaded = sys.modules.get("convert_lora_to_gguf")
    if loaded is not None:
        return loaded
    path = converter_dir(bin_dir) / LORA_SCRIPT
    spec = importlib.util.spec_from_file_location("convert_lora_to_gguf", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise ToolMissing(
            f"llama.cpp's {LORA_SCRIPT} not found at {path}; run `make llama-cpp` "
            "(scripts/build_llama_cpp.sh keeps it beside the converter classes)"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        with _environ(NO_LOCAL_GGUF="1"):  # it would put its own gguf-py on sys.path
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def plan_lora_conversion(
    root: Path,
    config: dict[str, Any],
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    ftype: str,
    *,
    adapter_root: Path | None = None,
    bin_dir: Path | None = None,
    metadata: bool = True,
) -> Conversion:
    """What ``convert_lora_to_gguf.py --base root`` writes for a LoRA adapter on the checkpoint
    in ``root``: ``<gguf name>.lora_a`` / ``.lora_b`` for every targeted weight, transformed as
    upstream's class for the base transforms the weight (q/k permutations act on ``B``), and the
    adapter keys (``general.type`` adapter, ``adapter.type`` lora, ``adapter.lora.alpha``).

    ``factors``: base weight name -> (``A`` ``(r, in)``, ``B`` ``(out, r)``) in float32, with any
    scale llama.cpp's ``alpha / r`` does not express already folded into ``B`` by the caller.
    Every tensor is computed (:class:`OneShot`); the base's weights are never read. Raises
    :class:`UnsupportedExport` when upstream's class writes no tensor for a targeted weight or
    cannot follow its transform with two factors (upstream would drop the first silently)."""
    conversion = load_converter(bin_dir)
    lora_module = load_lora_converter(bin_dir)
    import gguf

    lazy_type: Any = importlib.import_module("conversion.base").LazyTorchTensor
    lora_type: Any = lora_module.LoraTorchTensor
    arch = hf_architecture(config)
    try:
        model_class: Any = conversion.get_model_class(arch)
    except NotImplementedError:
        raise UnsupportedExport(f"llama.cpp's converter does not support {arch}") from None
    model_class = delegate_class(model_class, config)
    produced: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    written: set[str] = set()

    def index_tensors(self: Any, remote_hf_model_id: str | None = None) -> dict[str, Any]:
        return {}  # the adapter's tensors come from get_tensors; the base's are not read

    def get_tensors(self: Any) -> Iterator[tuple[str, Any]]:
        for name, (a, b) in factors.items():
            item = self.filter_tensors((name, lambda: None))
            if item is None:
                raise UnsupportedExport(
                    f"llama.cpp's {model_class.__name__} drops {name!r}, which the adapter targets"
                )
            renamed[item[0]] = name
            yield item[0], lora_type(lazy_type.from_eager(a), lazy_type.from_eager(b))

    def modify_tensors(self: Any, data: Any, name: str, bid: int | None) -> Iterable[Any]:
        out = []
        for new_name, tensor in model_class.modify_tensors(self, data, name, bid):
            if not isinstance(tensor, lora_type):
                raise UnsupportedExport(f"{name}: upstream made {new_name} a plain tensor")
            a, b = tensor.get_lora_A_B()
            if "token_embd.weight" in new_name:
                a = a.T  # upstream: llama.cpp's embedding LoRA takes A transposed
            for suffix, factor in ((".lora_a", a), (".lora_b", b)):
                produced[new_name + suffix] = factor
                out.append((new_name + suffix, factor))
        if not out:
            raise UnsupportedExport(
                f"llama.cpp's {model_class.__name__} writes nothing for {name!r}, which the "
                "adapter targets (a tied output projection, say)"
            )
        written.add(renamed.get(name, name))
        return out

    def set_type(self: Any) -> None:
        self.gguf_writer.add_type(gguf.GGUFType.ADAPTER)
        self.gguf_writer.add_string(gguf.Keys.Adapter.TYPE, "lora")

    def set_gguf_parameters(self: Any) -> None:
        self.gguf_writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))

    fed = type(
        f"Lora{model_class.__name__}",
        (model_class,),
        {
            "model_arch": model_class.model_arch,
            "index_tensors": index_tensors,
            "get_tensors": get_tensors,
            "modify_tensors": modify_tensors,
            "set_vocab": lambda self: None,
            "set_type": set_type,
            "set_gguf_parameters": set_gguf_parameters,
            "generate_extra_tensors": lambda self: (),  # never rope_freqs in an adapter
        },
    )
    hparams = dict(model_class.load_hparams(Path(root), False))
    hparams["architectures"] = hparams.get("architectures") or [arch]
    hparams.pop("quantization_config", None)  # the adapter's factors are float
    try:
        model = fed(
            Path(root),
            gguf.LlamaFileType[FTYPES[ftype]],
            Path(root) / "lora.gguf",
            eager=False,
            hparams=hparams,
        )
        if adapter_root is not None:
            model.dir_model_card = adapter_root  # as upstream's LoraModel does
        model.prepare_tensors()
        if metadata:
            model.prepare_metadata(vocab_only=False)
    except UnsupportedExport:
        raise
    except (KeyError, ValueError, AssertionError, NotImplementedError, TypeError) as exc:
        raise UnsupportedExport(
            f"llama.cpp's LoRA converter ({model_class.__name__}) cannot convert this adapter: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    tensors = []
    for name, info in model.gguf_writer.tensors[0].items():
        tensor = produced[name]
        shape = tuple(int(d) for d in tensor.shape)
        compute = OneShot(tensor, lazy_type)
        tensors.append(
            ConvertedTensor(name, shape, int(info.dtype), int(info.nbytes), None, compute)
        )
    model.gguf_writer.tensors.clear()
    produced.clear()
    kv = list(model.gguf_writer.kv_data[0].items()) if metadata else []
    return Conversion(
        hf_architecture=arch,
        arch_name=str(gguf.MODEL_ARCH_NAMES[model_class.model_arch]),
        model_class=model_class.__name__,
        tensors=tensors,
        metadata=kv,
        unused=sorted(set(factors) - written),
    )
