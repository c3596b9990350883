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
* upstream's VLM classes reading the published layout (Gemma 3's ``Gemma3VisionModel`` maps
  ``vision_tower.vision_model.*``, not the ``vision_tower.*`` transformers 5 saves for a model
  it built): a VLM's tensors are handed over under the names transformers' own rules give them
  in the published layout (:func:`published_layout`, ``shims.transformers_keys``);
* ``conversion/base.py`` leaving ``sys.path`` alone when ``NO_LOCAL_GGUF`` is set;
* ``GPTNeoXModel`` reading ``hparams["rotary_pct"]``, which transformers 5's config keeps as
  ``rope_parameters["partial_rotary_factor"]`` (:func:`upstream_hparams` puts it back);
* ``map_tensor_name`` raising ``ValueError("Can not map tensor ...")`` for a name the
  architecture has no tensor for, which the recorder tolerates for the reader's alias of a tied
  weight only (Command-R has no output tensor);
* which classes write their vocabulary from ``tokenizer.model`` only, and Gemma 3's reading the
  tokenizer's size for its embedding (``vocab``);
* ``convert_lora_to_gguf.py`` importable as a module (its script body runs under ``__main__``),
  its ``LoraTorchTensor(A, B)`` following the base class's tensor transforms, and its
  ``LoraModel`` overriding exactly :data:`LORA_MODEL_METHODS`, which
  :func:`plan_lora_conversion` mirrors (the class itself is defined under ``__main__``).

The converter needs the gguf-py of the same llama.cpp, which is newer than PyPI's ``gguf`` of the
same version string. It is the venv's one ``gguf`` package (``make install``, the image and CI
install it with ``scripts/install_gguf_py.sh``), so the writer, the planner and the offload
store's GGML blocks agree on every enum and constant; :func:`load_converter` refuses to run on
any other ``gguf`` rather than swap modules under the process.

The package keeps every use of llama.cpp's converter internals in one place, next to the list of
assumptions above, so an upgrade of llama.cpp is checked against one package and one test
module. Its modules, each importing only those above it:

* ``loader``: where the converter is (:func:`converter_dir`), what it supports (read without
  importing it), and importing it on the pinned gguf-py (:func:`load_converter`);
* ``lazy``: reading upstream's lazy tensors: what a tensor is a copy, a row, the first rows or
  a stack of (:func:`leading_rows`, :func:`picked_row`, :func:`stacked_rows`), and evaluating
  one once (:class:`OneShot`);
* ``classes``: upstream's class for a checkpoint (:func:`hf_architecture`,
  :func:`delegate_class`, :func:`upstream_modify`) and the hyperparameters it reads
  (:func:`upstream_hparams`);
* ``vocab``: the tokenizer files upstream's classes read, judged from a file list without
  importing the converter (the GGUF exporter's submission check);
* ``model``: :func:`plan_conversion`, upstream's class run on a checkpoint's metadata, its hooks
  a :class:`ConversionRecorder`'s methods and what they record its attributes;
* ``lora``: :func:`plan_lora_conversion`, the same for a PEFT LoRA adapter.
"""

from service.shims.llama_cpp_convert.classes import (
    TRANSPOSED_EXPERTS_CLASSES,
    break_row_filtered,
    delegate_class,
    hf_architecture,
    published_layout,
    upstream_hparams,
    upstream_modify,
)
from service.shims.llama_cpp_convert.lazy import (
    ConverterReader,
    OneShot,
    leading_rows,
    picked_row,
    row_reader,
    stacked_rows,
)
from service.shims.llama_cpp_convert.loader import (
    CHECKED_VERSIONS,
    converter_dir,
    gguf_py_mismatch,
    load_converter,
    mmproj_architecture,
    supported_architectures,
    supported_mmproj_architectures,
)
from service.shims.llama_cpp_convert.lora import (
    LORA_MODEL_METHODS,
    LORA_SCRIPT,
    load_lora_converter,
    plan_lora_conversion,
)
from service.shims.llama_cpp_convert.model import (
    FTYPES,
    Conversion,
    ConversionRecorder,
    ConvertedTensor,
    plan_conversion,
)

__all__ = [
    "CHECKED_VERSIONS",
    "FTYPES",
    "LORA_MODEL_METHODS",
    "LORA_SCRIPT",
    "TRANSPOSED_EXPERTS_CLASSES",
    "Conversion",
    "ConversionRecorder",
    "ConvertedTensor",
    "ConverterReader",
    "OneShot",
    "break_row_filtered",
    "converter_dir",
    "delegate_class",
    "gguf_py_mismatch",
    "hf_architecture",
    "leading_rows",
    "load_converter",
    "load_lora_converter",
    "mmproj_architecture",
    "picked_row",
    "plan_conversion",
    "plan_lora_conversion",
    "published_layout",
    "row_reader",
    "stacked_rows",
    "supported_architectures",
    "supported_mmproj_architectures",
    "upstream_hparams",
    "upstream_modify",
]
