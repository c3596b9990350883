"""A PEFT LoRA adapter as ``convert_lora_to_gguf.py`` writes it: upstream's class for the base,
fed the adapter's factors (see the package doc)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from service.errors import ToolMissing, UnsupportedExport
from service.shims.llama_cpp_convert.classes import delegate_class, hf_architecture
from service.shims.llama_cpp_convert.lazy import OneShot
from service.shims.llama_cpp_convert.loader import converter_dir, load_converter, temporary_environ
from service.shims.llama_cpp_convert.model import FTYPES, Conversion, ConvertedTensor

if TYPE_CHECKING:
    import torch


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
        with temporary_environ(NO_LOCAL_GGUF="1"):  # it would put its own gguf-py on sys.path
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
