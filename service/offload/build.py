"""Build the checkpoint's architecture on the ``meta`` device and match its keys.

A meta model has every parameter's shape and dtype but no storage, so even a 70B skeleton costs
a few megabytes and well under a second; weights arrive later, tensor by tensor, from
:mod:`service.offload.dispatch`. Buffers stay real (``init_empty_weights`` keeps them on CPU):
they are tiny and some (rotary ``inv_freq``) are computed at construction, not stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from service.checkpoint.base import Checkpoint, TensorInfo
from service.checkpoint.experts import as_model_names
from service.config import Settings
from service.errors import NoModelConfig
from service.shims.transformers_keys import key_renamer
from service.stage import JobContext, Phase
from service.tensors import dtype_name

COMMON_MODEL_MODULES = (
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
)
"""Model code most jobs build (Llama-style decoders, BERT-style encoders), which transformers
imports only on first use: the job forkserver imports it once
(:mod:`service.jobs.executors.preload`), so that a job starts without seconds of imports."""


@dataclass(frozen=True)
class KeysReport:
    """How the checkpoint's tensor names line up with the module's."""

    matched: int
    missing: list[str]
    """Module tensors the checkpoint lacks (tied ones excluded: they come with their target)."""
    unexpected: list[str]
    """Checkpoint tensors the module has no place for."""
    tied: dict[str, str]
    """Module name -> the name whose data it shares (``lm_head.weight`` -> embeddings)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint name -> module name, when they differ by the base model prefix."""

    def to_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "tied": self.tied,
            "renamed": self.renamed,
        }


@dataclass
class BuiltModel:
    """A meta-device module plus what the pipeline publishes about it."""

    model: nn.Module
    architecture: str
    model_type: str
    dtype: torch.dtype
    parameter_count: int
    keys: KeysReport
    no_split_module_classes: list[str]

    def report(self) -> dict[str, Any]:
        """The ``model`` section of the job JSON."""
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "parameters": self.parameter_count,
            "dtype": dtype_name(self.dtype),
            "no_split_modules": self.no_split_module_classes,
            "keys": self.keys.to_json(),
        }


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        dtype: torch.dtype = getattr(torch, value)
        return dtype
    return None


def _checkpoint_dtype(infos: list[TensorInfo]) -> torch.dtype | None:
    """The floating dtype holding most bytes: what the weights really are."""
    totals: dict[torch.dtype, int] = {}
    for info in infos:
        if info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    return max(totals, key=lambda d: totals[d]) if totals else None


def load_config(checkpoint: Checkpoint, settings: Settings) -> Any:
    """A transformers config from the checkpoint's config.json, or :class:`NoModelConfig`."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = checkpoint.config
    if not raw or not isinstance(raw, dict):
        raise NoModelConfig(f"{checkpoint.root} has no config.json to build a model from")
    model_type = raw.get("model_type")
    if settings.trust_remote_code and "auto_map" in raw:
        config_dir = checkpoint.root if checkpoint.root.is_dir() else checkpoint.root.parent
        return AutoConfig.from_pretrained(
            str(config_dir), trust_remote_code=True, local_files_only=True
        )
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        hint = " (custom code: set trust_remote_code)" if "auto_map" in raw else ""
        raise NoModelConfig(f"config.json has no known model_type ({model_type!r}){hint}")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except (TypeError, ValueError) as exc:
        raise NoModelConfig(f"config.json is not a valid {model_type} config: {exc}") from exc


_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModel",
)
"""Tried in turn when config.json names no architecture (configs saved without a model)."""


def candidate_classes(config: Any) -> list[Any]:
    """Classes that could hold the checkpoint: the named architecture, else the auto heads."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return [cls]
    found = []
    for auto_name in _AUTO_CLASSES:
        mapping = getattr(transformers, auto_name)._model_mapping
        try:
            cls = mapping[type(config)]
        except KeyError:
            continue
        if cls not in found:
            found.append(cls)
    return found


def build_meta_model(config: Any, settings: Settings, dtype: torch.dtype, cls: Any) -> nn.Module:
    """Instantiate ``cls`` (or remote code when trusted and ``cls`` is None) with no weights."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), _skip_meta_initialization():
        if cls is not None:
            model = cls._from_config(config, dtype=dtype)
        elif settings.trust_remote_code and getattr(config, "auto_map", None):
            model = transformers.AutoModel.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype, trust_remote_code=True
            )
        else:
            raise NoModelConfig(f"transformers has no model for {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise NoModelConfig(f"{type(model).__name__} is not a torch module")
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # _from_config leaves tied heads (lm_head -> embeddings) untied
    return model.eval()


@contextmanager
def _skip_meta_initialization() -> Iterator[None]:
    """Skip weight initialization of meta tensors, keep it for real ones (buffers).

    Module constructors (``reset_parameters``) and ``post_init`` initialize every parameter even
    on meta, where torch's reference ``normal_``/``uniform_`` cost milliseconds a call: seconds
    for a 70B skeleton, for values that do not exist. Like transformers' ``no_init_weights`` we
    patch the init functions where they are looked up (its ``TORCH_INIT_FUNCTIONS`` table and
    the torch modules it lists), but only meta tensors are skipped.
    """
    import sys

    from transformers import initialization

    def skipping_meta(init: Callable[..., Any]) -> Callable[..., Any]:
        def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return tensor if tensor.is_meta else init(tensor, *args, **kwargs)

        return run

    table: dict[str, Callable[..., Any]] = initialization.TORCH_INIT_FUNCTIONS  # type: ignore[assignment]
    patched: list[tuple[Any, str, Any]] = [(table, name, init) for name, init in table.items()]
    for module_name in initialization.TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(module_name)
        for name in table:
            if module is not None and hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
    try:
        for owner, name, init in patched:
            if isinstance(owner, dict):
                owner[name] = skipping_meta(init)
            else:
                setattr(owner, name, skipping_meta(init))
        yield
    finally:
        for owner, name, init in reversed(patched):
            if isinstance(owner, dict):
                owner[name] = init
            else:
                setattr(owner, name, init)


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier one -> that earlier name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            tied[name] = canonical
    return tied


def module_tensor_names(model: nn.Module) -> list[str]:
    """Names of parameters and persistent buffers: what a state dict of the module holds."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for buffer_name in module._buffers:
            if buffer_name not in skip and module._buffers[buffer_name] is not None:
                names.append(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def match_keys(
    model: nn.Module, checkpoint_names: list[str], aliases: dict[str, str] | None = None
) -> KeysReport:
    """Line checkpoint names up with the module's, tolerating the base-model prefix."""
    module_names = module_tensor_names(model)
    module_set = set(module_names)
    tied = tied_names(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed: dict[str, str] = {}
    matched: set[str] = set()
    unexpected: list[str] = []
    checkpoint_set = set(checkpoint_names)
    rename = key_renamer(model)
    for name in checkpoint_names:
        target = resolve_name(name, module_set, prefix)
        if target is None:  # a layout transformers renames at load (a VLM's sub-models)
            target = resolve_name(rename(name), module_set, prefix)
        if target is None:
            unexpected.append(name)
            continue
        if target != name:
            renamed[name] = target
        matched.add(target)
    for alias, canonical in (aliases or {}).items():
        target = resolve_name(alias, module_set, prefix) or resolve_name(
            rename(alias), module_set, prefix
        )
        if target is not None and canonical in checkpoint_set:
            matched.add(target)
    missing = [
        n for n in module_names if n not in matched and not (n in tied and tied[n] in matched)
    ]
    return KeysReport(
        matched=len(matched),
        missing=missing,
        unexpected=unexpected,
        tied=tied,
        renamed=renamed,
    )


def resolve_name(name: str, module_names: set[str], prefix: str) -> str | None:
    """``name`` as the module calls it: as is, without ``prefix.``, or with it."""
    if name in module_names:
        return name
    if prefix:
        if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in module_names:
            return name[len(prefix) + 1 :]
        if f"{prefix}.{name}" in module_names:
            return f"{prefix}.{name}"
    return None


def build_on_meta(
    checkpoint: Checkpoint, settings: Settings, dtype: torch.dtype | None = None
) -> BuiltModel:
    """The checkpoint's architecture on ``meta`` with a keys report; :class:`NoModelConfig` if
    there is no usable config.json.

    ``dtype`` is the compute dtype of the module; by default the config's, else the dtype most
    of the checkpoint's bytes are in.
    """
    config = load_config(checkpoint, settings)
    infos = checkpoint.reader.tensor_infos()
    natural = _config_dtype(config) or _checkpoint_dtype(infos) or torch.float32
    dtype = dtype or natural
    best: tuple[int, nn.Module, KeysReport] | None = None
    for cls in candidate_classes(config) or [None]:
        candidate = build_meta_model(config, settings, dtype, cls)
        # a MoE's per-expert tensors as the model's expert stacks (what dispatch will load)
        reader = as_model_names(checkpoint.reader, candidate)
        names = [i.name for i in reader.tensor_infos()]
        report = match_keys(candidate, names, reader.aliases())
        misfit = len(report.missing) + len(report.unexpected)
        if best is None or misfit < best[0]:
            best = (misfit, candidate, report)
        if misfit == 0:
            break
    assert best is not None
    _, model, keys = best
    if dtype != natural:
        _buffers_as_in(model, build_meta_model(config, settings, natural, type(model)), dtype)
    return BuiltModel(
        model=model,
        architecture=type(model).__name__,
        model_type=str(getattr(config, "model_type", "")),
        dtype=dtype,
        parameter_count=sum(p.numel() for p in model.parameters()),
        keys=keys,
        no_split_module_classes=sorted(getattr(model, "_no_split_modules", None) or []),
    )


def _buffers_as_in(model: nn.Module, natural: nn.Module, dtype: torch.dtype) -> None:
    """Give ``model`` (built in ``dtype``, wider than its checkpoint's) the computed buffers the
    same architecture gets in its checkpoint's own dtype, cast to ``dtype``: what transformers'
    ``from_pretrained(dtype="auto")`` and then a cast hold. Gemma 3's ``embed_scale``,
    sqrt(hidden), is 25.25 in bfloat16 and 25.298 built in float32: the whole real Gemma 3 270M
    then computed 0.85% away from transformers' run of the same checkpoint, and its verified
    jobs failed. (Rotary ``inv_freq`` is float32 either way: transformers computes it so.)"""
    theirs = dict(natural.named_buffers())
    for name, buffer in model.named_buffers():
        other = theirs.get(name)
        if other is None or other.is_meta or buffer.is_meta or other.shape != buffer.shape:
            continue
        if buffer.dtype.is_floating_point and other.dtype.is_floating_point:
            buffer.copy_(other)  # cast to the buffer's dtype


def build_phase(
    checkpoint: Checkpoint,
    settings: Settings,
    ctx: JobContext,
    dtype: torch.dtype | None = None,
) -> BuiltModel | None:
    """The pipeline's BUILD phase: build on meta and publish ``details.model``.

    Returns None (and publishes why) when there is no usable config: state-dict-level exports
    still run; a stage that needs a module calls :func:`build_on_meta` and gets NoModelConfig.
    """
    ctx.set_phase(Phase.BUILD, total=None, unit="modules")
    try:
        built = build_on_meta(checkpoint, settings, dtype)
    except NoModelConfig as exc:
        ctx.set_detail("model", {"buildable": False, "reason": str(exc)})
        return None
    ctx.set_detail("model", {"buildable": True, **built.report()})
    return built
