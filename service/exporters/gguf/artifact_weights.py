"""The written GGUF's own weights as a checkpoint transformers loads: dequantized, in the
source's names and layout, for the exact check (``exact``).

llama.cpp's converter transforms some tensors on the way in (Llama's q/k rows permuted for its
rope, Gemma's norms stored as ``1 + w``, fused projections split, experts stacked). Its inverse
is found generically, not per family: the converter (``service.shims.llama_cpp_convert``, the
same classes that planned the file) is run on *probe* checkpoints of the same names and shapes,
whose values say where each element came from: every element's source tensor (``id``), its row
(``row``) and its position in the row (``col``), and zeros (``zero``: the constant the
transform adds). A tensor whose probes are not whole numbers, or whose random probe (``rand``)
is not moved exactly as the map says, is not a permutation plus a constant: it is reported as
not invertible and the exact check does not judge that file. Every family of the corpus is a
permutation plus a constant.

Each GGUF tensor is dequantized with gguf-py (``gguf.quants.dequantize``), put back where the
map says, and written as float32 safetensors shards of :data:`SHARD_BYTES` (float32: q8_0's
int8 x f16-scale products are not exact in any narrower type), with the source's config and
tokenizer files. Memory: no term as large as a tensor for the tensors the converter moves
unchanged (all but a few: the embedding, the head, every MLP and most attention matrices), which
are dequantized :data:`ROW_BLOCK_BYTES` of float32 rows at a time from the memory-mapped GGUF
into a safetensors file of their own (:func:`_stream_tensor`); the transformed ones (Llama's
q/k, Gemma's norms, fused projections) one tensor and its probes at a time, small ones one shard
at a time. Disk: 4 bytes per parameter, removed by the caller.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import VerificationFailed
from service.verification.weight_error import WEIGHT_ERROR_BOUND, relative_error

if TYPE_CHECKING:
    import numpy as np
    import torch

    from service.checkpoint.base import WeightReader
    from service.exporters.gguf.directory import StoredTensor

SHARD_BYTES = 256 << 20
"""float32 bytes per written shard."""
ROW_BLOCK_BYTES = 32 << 20
"""float32 bytes of rows dequantized at once; a tensor moved unchanged of more than this is
streamed to a file of its own."""
PROBES = ("zero", "row", "col", "id", "rand")


class NotInvertible(Exception):
    """A converter transform that is not a permutation plus a constant."""


@dataclass
class ArtifactWeights:
    """Where the file's weights were written, and what the map found."""

    directory: Path
    ggml_types: dict[str, str] = field(default_factory=dict)
    """Checkpoint tensor -> the GGUF type it was stored as (for ggml's activation rounding)."""
    transformed: list[str] = field(default_factory=list)
    """GGUF tensors the converter transformed (inverted through the probes)."""
    from_source: list[str] = field(default_factory=list)
    """Checkpoint tensors the file does not hold (llama.cpp computes or ignores them)."""
    largest_error: tuple[str, float] = ("", 0.0)
    """The tensor whose stored values are farthest from the source's, and that distance
    (relative RMS error, :func:`relative_error`)."""


class _ProbeReader:
    """A checkpoint of the reader's names and shapes, in float32, whose values are a probe."""

    def __init__(self, reader: WeightReader, probe: str, ids: dict[str, int]) -> None:
        self.reader, self.probe, self.ids = reader, probe, ids
        self._aliases = reader.aliases()

    def tensor_infos(self) -> list[Any]:
        import torch

        return [replace(info, dtype=torch.float32) for info in self.reader.tensor_infos()]

    def aliases(self) -> dict[str, str]:
        return self._aliases

    def read(self, name: str) -> torch.Tensor:
        return probe_values(self.probe, self.ids[self._aliases.get(name, name)], self._shape(name))

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        yield self.read(name).reshape(-1)

    def _shape(self, name: str) -> tuple[int, ...]:
        canonical = self._aliases.get(name, name)
        for info in self.reader.tensor_infos():
            if info.name == canonical:
                return tuple(info.shape)
        raise KeyError(name)


def probe_values(probe: str, ident: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Probe ``probe`` of the tensor numbered ``ident`` (from 1) of ``shape``."""
    import math

    import torch

    if probe == "zero":
        return torch.zeros(shape)
    if probe == "id":
        return torch.full(shape, float(ident))
    if probe == "rand":
        return torch.randn(shape, generator=torch.Generator().manual_seed(ident))
    rows, cols = shape[0] if shape else 1, math.prod(shape[1:])
    if probe == "row":
        if len(shape) == 1:
            return torch.arange(rows, dtype=torch.float32)
        return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, cols).reshape(shape).clone()
    if len(shape) == 1:
        return torch.zeros(shape)
    return torch.arange(cols, dtype=torch.float32)[None, :].expand(rows, cols).reshape(shape).clone()


def _conversions(
    root: Path, config: dict[str, Any], reader: WeightReader, bin_dir: Path | None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, int]]:
    """The plain conversion's tensors by GGUF name, each probe's computed tensors by name, and
    the probes' tensor numbering."""
    from service.shims.llama_cpp_convert import plan_conversion

    ids = {info.name: i + 1 for i, info in enumerate(reader.tensor_infos())}
    plans: dict[str, dict[str, Any]] = {}
    for probe in PROBES:
        conversion = plan_conversion(
            root, config, _ProbeReader(reader, probe, ids), "f32", bin_dir=bin_dir,
            metadata=False, vocab=False,
        )  # fmt: skip
        plans[probe] = {t.name: t for t in conversion.tensors}
    return plans["zero"], plans, ids


def _inverse(
    name: str, probes: dict[str, np.ndarray], shapes: dict[int, tuple[str, tuple[int, ...]]]
) -> tuple[np.ndarray, list[tuple[str, np.ndarray, np.ndarray]]]:
    """For a computed GGUF tensor: its constant, and per source tensor the flat output
    positions and the flat source positions they hold; NotInvertible when it is not that."""
    import numpy as np

    zero = probes["zero"].reshape(-1).astype(np.float64)
    got = {k: probes[k].reshape(-1).astype(np.float64) - zero for k in ("row", "col", "id")}
    for key, values in got.items():
        if not np.array_equal(values, np.round(values)):
            raise NotInvertible(f"{name}: its {key} probe is not whole numbers")
    ident = got["id"].astype(np.int64)
    pieces = []
    rand = probes["rand"].reshape(-1).astype(np.float64) - zero
    for tensor_id in np.unique(ident):
        if int(tensor_id) not in shapes:
            raise NotInvertible(f"{name}: an element from no source tensor")
        source, shape = shapes[int(tensor_id)]
        where = np.flatnonzero(ident == tensor_id)
        cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        flat = got["row"][where].astype(np.int64) * cols + got["col"][where].astype(np.int64)
        if len(shape) == 1:
            flat = got["row"][where].astype(np.int64)
        if flat.min() < 0 or flat.max() >= int(np.prod(shape)):
            raise NotInvertible(f"{name}: a probe points outside {source}")
        expected = probe_values("rand", int(tensor_id), shape).numpy().reshape(-1)[flat]
        if not np.allclose(rand[where], expected, rtol=1e-6, atol=1e-6):
            raise NotInvertible(f"{name}: {source}'s values are not moved unchanged")
        pieces.append((source, where, flat))
    return zero, pieces


def _stream_tensor(
    path: Path, name: str, shape: tuple[int, ...], blocks: Iterator[np.ndarray]
) -> None:
    """One float32 tensor as a safetensors file written block by block (the format: an 8-byte
    little-endian header length, the JSON header padded to 8 bytes, the row-major data), where
    ``safetensors.numpy.save_file`` needs the whole array; the blocks' sizes must add up."""
    import struct

    import numpy as np

    nbytes = int(np.prod(shape)) * 4
    header = json.dumps({name: {"dtype": "F32", "shape": list(shape),
                                "data_offsets": [0, nbytes]}}, separators=(",", ":")).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    written = 0
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for block in blocks:
            data = np.ascontiguousarray(block, dtype=np.float32)
            f.write(data.tobytes())
            written += data.nbytes
    if written != nbytes:
        raise VerificationFailed(f"{name}: {written} bytes streamed for a {nbytes}-byte tensor")


def stored_tensors(path: Path) -> Iterator[tuple[StoredTensor, np.ndarray]]:
    """Each tensor of the GGUF file at ``path`` with its data mapped as ``gguf.GGUFReader``
    shapes it (float32/float16 elements in row-major shape; any other type its rows' bytes), for
    ``gguf.quants.dequantize``. The directory is read by :func:`directory.read_directory`:
    ``GGUFReader`` materializes every vocabulary entry as a numpy view, a minute of a Gemma 3
    f16 check's (262k tokens) for nothing the check reads."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from service.exporters.gguf.directory import read_directory

    directory = read_directory(path)
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    for tensor in directory.tensors:
        kind = GGMLQuantizationType(tensor.ggml_type)
        block, type_size = GGML_QUANT_SIZES[kind]
        row = tensor.shape[-1]
        rows = int(np.prod(tensor.shape[:-1], dtype=np.int64))
        row_bytes = row // block * type_size
        raw = mapped[tensor.offset : tensor.offset + rows * row_bytes]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if kind == GGMLQuantizationType.F32 else np.float16
            yield tensor, raw.view(dtype).reshape(tensor.shape)
        else:
            yield tensor, raw.reshape(*tensor.shape[:-1], row_bytes)


def _row_blocks(data: np.ndarray, kind: Any, row_elements: int) -> Iterator[np.ndarray]:
    """``data`` (a GGUF tensor's mapped rows, any leading dims) dequantized
    :data:`ROW_BLOCK_BYTES` of float32 rows at a time."""
    from gguf import quants

    rows = data.reshape(-1, data.shape[-1])
    step = max(1, ROW_BLOCK_BYTES // (4 * max(1, row_elements)))
    for start in range(0, rows.shape[0], step):
        yield quants.dequantize(rows[start : start + step], kind).reshape(-1)


def write_artifact_weights(
    gguf_path: Path,
    root: Path,
    config: dict[str, Any],
    reader: WeightReader,
    out: Path,
    bin_dir: Path | None = None,
) -> ArtifactWeights:
    """The file's weights as a float32 checkpoint in ``out`` (module docstring); raises
    NotInvertible for a transform the probes cannot undo."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import save_file

    from service.checkpoint import AUX_PATTERNS

    plain, probes, ids = _conversions(root, config, reader, bin_dir)
    infos = {info.name: info for info in reader.tensor_infos()}
    aliases = reader.aliases()
    shapes = {i: (n, tuple(infos[n].shape)) for n, i in ids.items()}
    out.mkdir(parents=True, exist_ok=True)
    result = ArtifactWeights(out)
    pending: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / file))
            weight_map.update(dict.fromkeys(shard, file))
            shard.clear()

    def source_chunks(name: str) -> Iterator[np.ndarray]:
        for chunk in reader.iter_chunks(name, ROW_BLOCK_BYTES):
            yield chunk.to(torch.float32).numpy()

    def compared(name: str, stored: Iterator[np.ndarray]) -> None:
        """The stored values of ``name`` against the source's (:data:`WEIGHT_ERROR_BOUND`)."""
        error = relative_error(stored, source_chunks(name))
        if not error <= WEIGHT_ERROR_BOUND:  # NaN fails too
            raise VerificationFailed(
                f"{name}: the GGUF's values are not the source's (relative RMS error "
                f"{error:.3g} > {WEIGHT_ERROR_BOUND}, where the type's rounding costs a fraction "
                "of that): the file holds other rows, scales or a transform of this tensor"
            )
        if error >= result.largest_error[1]:
            result.largest_error = (name, error)

    def emit(name: str, values: np.ndarray, stored: bool = True) -> None:
        shard[name] = np.ascontiguousarray(values, dtype=np.float32)
        if stored:
            compared(name, iter([shard[name]]))
        if sum(a.nbytes for a in shard.values()) >= SHARD_BYTES:
            flush()

    def stream(source: str, blocks: Iterator[np.ndarray]) -> None:
        file = f"model-streamed-{len(streamed) + 1:05d}.safetensors"
        shape = tuple(infos[source].shape)
        _stream_tensor(out / file, source, shape, blocks)
        weight_map[source] = file
        streamed.append(source)
        data = np.memmap(out / file, dtype=np.float32, mode="r", shape=(int(np.prod(shape)),),
                         offset=(out / file).stat().st_size - 4 * int(np.prod(shape)))  # fmt: skip
        step = max(1, ROW_BLOCK_BYTES // 4)
        compared(source, (data[i : i + step] for i in range(0, data.size, step)))
        del data

    def with_source_tail(source: str, head: Iterator[np.ndarray], held: int) -> Iterator[
            np.ndarray]:  # fmt: skip
        """The file's leading elements, then the source's beyond them (Gemma's trimmed
        vocabulary: llama.cpp holds the first rows)."""
        yield from head
        seen = 0
        for chunk in reader.iter_chunks(source, ROW_BLOCK_BYTES):
            flat = chunk.to(torch.float32).numpy().reshape(-1)
            if seen + flat.size > held:
                yield flat[max(0, held - seen):]
            seen += flat.size

    streamed: list[str] = []
    for tensor, data in stored_tensors(gguf_path):
        kind = GGMLQuantizationType(tensor.ggml_type)
        shape = tensor.shape
        planned = plain.get(tensor.name)
        if planned is None:
            raise VerificationFailed(f"{tensor.name}: in the file, not in the converter's plan")
        type_name = kind.name.lower()
        elements = int(np.prod(shape))
        if planned.source is not None and elements * 4 > ROW_BLOCK_BYTES:
            source = aliases.get(planned.source, planned.source)
            result.ggml_types[source] = type_name
            blocks = _row_blocks(data, kind, shape[-1])
            if elements != infos[source].numel:
                blocks = with_source_tail(source, blocks, elements)
            stream(source, blocks)
            continue
        values = np.asarray(quants.dequantize(data, kind), dtype=np.float32).reshape(shape)
        if planned.source is not None:
            source = aliases.get(planned.source, planned.source)
            result.ggml_types[source] = type_name
            if values.size != infos[source].numel:  # leading rows (Gemma's trimmed vocabulary)
                whole = reader.read(source).to(torch.float32).numpy()
                whole.reshape(-1)[: values.size] = values.reshape(-1)
                values = whole
            emit(source, values.reshape(infos[source].shape))
        elif planned.parts:
            for k, part in enumerate(planned.parts):
                part = aliases.get(part, part)
                result.ggml_types[part] = type_name
                emit(part, values[k].reshape(infos[part].shape))
        else:
            computed = {p: probes[p][tensor.name].compute() for p in PROBES}
            zero, pieces = _inverse(tensor.name, computed, shapes)
            result.transformed.append(tensor.name)
            flat = values.reshape(-1).astype(np.float64) - zero
            for source, where, at in pieces:
                buffer = pending.setdefault(source, np.zeros(infos[source].numel, dtype=np.float32))
                buffer[at] = flat[where]
                filled[source] = filled.get(source, 0) + len(at)
                result.ggml_types[source] = type_name
                if filled[source] >= infos[source].numel:
                    emit(source, pending.pop(source).reshape(infos[source].shape))
        del values
    for source in list(pending):  # partly held: the rest from the source (llama.cpp lacks it)
        result.from_source.append(source)
        emit(source, pending.pop(source).reshape(infos[source].shape), stored=False)
    for name in infos:
        if name not in result.ggml_types and name not in aliases:
            result.from_source.append(name)
            emit(name, reader.read(name).to(torch.float32).numpy(), stored=False)
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    for path in root.iterdir():
        import fnmatch

        if path.is_file() and any(fnmatch.fnmatchcase(path.name, p) for p in AUX_PATTERNS):
            shutil.copy(path, out / path.name)
    saved = {k: v for k, v in config.items() if k != "quantization_config"}
    saved["torch_dtype"] = saved["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    return result
