"""A small ``tract``-compatible command built on the PyPI ``tract`` bindings.

torch-to-nnef's ``TractNNEF`` target wants a tract CLI binary: its constructor downloads one
unless given ``specific_tract_binary_path``, which cannot work offline. This module answers the
subset of the real CLI that torch-to-nnef invokes (``inference_target/tract.py``)::

    tract --version
    tract MODEL.nnef.tgz --nnef-tract-core --nnef-tract-pulse [--nnef-tract-extra]
          [--nnef-tract-transformers] -O run --input-from-bundle IN.npz
          (--assert-output-bundle OUT.npz [--approx LEVEL] | --save-outputs-npz OUT.npz)
          [--allow-float-casts]

Two commands of its own serve :mod:`service.exporters.nnef.verify`, which runs tract in a child
process (tract holds the whole archive in RAM; the job process must not)::

    tract MODEL.nnef.tgz decode --input-from-bundle REQUEST.npz --save-outputs-npz OUT.npz
          [--layer-outputs WORK_DIR]
    tract MODEL.nnef.tgz logits --input-from-bundle REQUEST.npz --save-outputs-npz OUT.npz

``logits`` (:func:`run_chunks`) gives the logits of the fixed text's scored positions, chunk by
chunk, for the check against transformers' (``service.verification.logits``); a ``decode`` request
that also holds ``logits``' keys (``chunks``, ``first``, ``last``) gives both (``chunk_logits``
beside ``logits``) from one load of the archive, which for a float32 model costs about as much as
all the runs together (reading, unpacking and packing every weight); ``layerwise-logits``
(:func:`run_layerwise_chunks`) gives the same from the blocks below, each fed the block before it,
each block running a chunk's scored positions at once (two runs a chunk, the head's statements
copied onto every position by :func:`head_over_every_position`) rather than one run a position;
``scored_by`` in OUT.npz says which ran.

``REQUEST.npz`` holds ``prompt`` [1,S], ``tokens`` [n] and ``cache_shapes`` [k,4] (past axis 0,
dtypes ``cache_dtypes``); it replays a greedy decode feeding back tract's own KV cache and saves
the last-position logits of every step as ``logits`` [n,vocab]. With ``--layer-outputs`` the
archive is unpacked into WORK_DIR, every layer's output is made a graph output, and their last
positions are saved too (``layers`` [n,layers,hidden], ``names``): what a failed check needs to
say which layer diverges first.

One more runs the blocks :mod:`service.exporters.nnef.layerwise` cut from the archive, one at a
time (the peak is one block's weights, not the model's)::

    tract WORK_DIR layerwise --input-from-bundle REQUEST.npz --save-outputs-npz OUT.npz

``WORK_DIR/blocks.json`` lists the blocks; ``REQUEST.npz`` is the decode's plus ``hidden``
[layers,T,width], PyTorch's output of every layer at every position, fed to the block after it.
Each block replays the same teacher-forced decode; every layer's output is saved as
``hidden_<layer>`` [T,width], the head's last-position logits as ``logits``, and each block's
peak RSS (``VmHWM`` reset before it loads) as ``block_peak_rss_bytes``. The embedding lookup's
block, where there is one, is fed to layer 0 as tract computed it, as is a ``carried`` value
inside a layer cut below it (fed to the blocks after by its name); the lookup, the head and a
matrix's product run in chunks of the matrix's rows where ``blocks.json`` says so (``chunks``).

Run it as ``python service/exporters/nnef/tract_cli.py`` (it imports nothing of the service but
its sibling :mod:`~service.exporters.nnef.graph_text`, the graph's text surgery, from its own
directory, so the call costs the tract import only); :func:`write_launcher` writes an executable
wrapper for code that needs a file path. Anything else (``dump``, ONNX input) exits with status 2
and an ``ERROR`` line, which torch-to-nnef reports as a tract failure.

Why one module of over 450 lines: it is the child's whole program, every command above built on
the same few runs (load an archive or a block, decode a prompt, score a chunk) and answered by
one ``main``; what the job process also needs of it, the graph's text surgery, is apart in
``graph_text``. Split further, each piece would be one more sibling the child imports from its
directory, and the commands would read their shared runs across files.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__:  # imported as service.exporters.nnef.tract_cli: the job process, the tests
    from service.exporters.nnef.graph_text import (
        ALL_POSITIONS_SUFFIX,
        expose_layer_outputs,
        head_over_every_position,
        layer_outputs,
    )
else:  # run by path, the child: graph_text.py is beside it, in the script's directory on sys.path
    from graph_text import (  # type: ignore[no-redef]
        ALL_POSITIONS_SUFFIX,
        expose_layer_outputs,
        head_over_every_position,
        layer_outputs,
    )


@dataclass(frozen=True)
class ApproximationBounds:
    """The bounds of one of tract's approximation levels, as its ``close_enough`` applies them:
    |a-b| <= atol + rtol*|b| except for an ``outliers`` fraction."""

    atol: float
    rtol: float
    outliers: float = 0.0


# tract's Approximation levels (tract-core ``Approximation``), by their CLI names.
APPROXIMATION_BOUNDS: dict[str, ApproximationBounds] = {
    "exact": ApproximationBounds(0.0, 0.0),
    "close": ApproximationBounds(1e-7, 1e-7),
    "approximate": ApproximationBounds(1e-4, 5e-4),
    "very": ApproximationBounds(5e-3, 1e-2),
    "super": ApproximationBounds(0.1, 0.05, 1e-4),
    "ultra": ApproximationBounds(0.2, 0.1, 5e-3),
}


def tract_version() -> str:
    import tract

    return str(tract.version())


def load_runnable(model_path: Path, *, transformers: bool = True, extra: bool = True) -> Any:
    """Load an NNEF archive or directory with tract and make it runnable."""
    import tract

    nnef = tract.nnef()
    if extra:
        nnef = nnef.with_tract_extra()
    if transformers:
        nnef = nnef.with_tract_transformers()
    model = nnef.with_pulse().load(str(model_path))
    return model.into_runnable()


def run_bundle(runnable: Any, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``runnable`` on npz-bundle inputs given in graph input order."""
    arrays = [np.ascontiguousarray(v) for v in inputs.values()]
    return [t.to_numpy() for t in runnable.run(arrays)]


_TRACT_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64"}


def fact_dtype(fact: Any, fallback: str) -> str:
    """The dtype tract expects for an input (its fact prints as ``1,2,P,16,F16``)."""
    return _TRACT_DTYPES.get(str(fact).rsplit(",", 1)[-1].strip(), fallback)


def run_decode(
    runnable: Any, request: dict[str, np.ndarray], extra_outputs: int = 0
) -> tuple[np.ndarray, np.ndarray | None]:
    """Teacher-forced greedy decode: the prompt with empty caches, then each given token with
    tract's own caches fed back; the last position's logits at every step, and the last
    position of each of the graph's ``extra_outputs`` trailing outputs (the layer outputs
    :func:`expose_layer_outputs` added) as ``[steps, extra, width]``."""
    caches = []
    dtypes = [str(d) for d in request["cache_dtypes"]]
    for i, (shape, dtype) in enumerate(zip(request["cache_shapes"], dtypes, strict=True), 1):
        caches.append(
            np.zeros([int(d) for d in shape], dtype=fact_dtype(runnable.input_fact(i), dtype))
        )
    step_ids = np.ascontiguousarray(request["prompt"], dtype=np.int64)
    found = []
    layers = []
    for token in request["tokens"]:
        outputs = [t.to_numpy() for t in runnable.run([step_ids, *caches])]
        found.append(outputs[0].reshape(-1, outputs[0].shape[-1])[-1])
        if extra_outputs:
            extra, outputs = outputs[-extra_outputs:], outputs[:-extra_outputs]
            layers.append(np.stack([_last_position(x) for x in extra]))
        caches = outputs[1:]
        step_ids = np.asarray([[int(token)]], dtype=np.int64)
    return np.stack(found), (np.stack(layers) if extra_outputs else None)


def run_chunks(runnable: Any, request: dict[str, np.ndarray]) -> np.ndarray:
    """The logits of positions ``[first, last)`` of each chunk of ``request["chunks"]``
    ``(n_chunk, n_ctx)``, each chunk from empty caches, as ``(n_chunk, last - first, vocab)``.

    The archive's graph gives the last position's logits only, so each chunk is the prompt up
    to ``first`` then one token a step with tract's own caches fed back (how it is served);
    ``cache_shapes``/``cache_dtypes`` as for ``decode``."""
    first, last = int(request["first"]), int(request["last"])
    found = []
    for chunk in np.asarray(request["chunks"], dtype=np.int64):
        steps = {
            "prompt": chunk[None, : first + 1],
            "tokens": chunk[first + 1 : last + 1],
            "cache_shapes": request["cache_shapes"],
            "cache_dtypes": request["cache_dtypes"],
        }
        logits, _ = run_decode(runnable, steps)
        found.append(logits.astype(np.float32))
    return np.stack(found)


# --- the fixed text's window at once, block by block ------------------------------------------

def _last_position(x: np.ndarray) -> np.ndarray:
    last: np.ndarray = x.reshape(-1, x.shape[-1])[-1].astype(np.float32)
    return last


def _vm_hwm() -> int:
    """This process's peak RSS in bytes since the last :func:`_reset_hwm` (0 where unknown)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else 0


def _reset_hwm() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux's ``clear_refs`` 5), so each block's peak is
    its own; where the kernel refuses, the peaks stay cumulative (an upper bound)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _block_steps(
    runnable: Any,
    block: dict[str, Any],
    prompt: np.ndarray,
    tokens: np.ndarray,
    hidden: Any,
    shapes: list[list[int]],
    dtypes: list[str],
    rows: tuple[int, int] | None = None,
    window: bool = False,
) -> dict[str, list[np.ndarray]]:
    """One block over a teacher-forced decode (``prompt``, then each of ``tokens`` but the last
    a step, as :func:`run_decode`), feeding back its own KV caches and ``hidden[layer]``
    ``[positions, width]`` to a hidden input; its outputs by kind (``hidden_<layer>`` rows of
    every position, ``logits`` of the last position), one entry a step. ``rows``: the block is
    a chunk of the vocabulary matrix's rows ``[a, b)`` (``layerwise``'s module doc): the ids it
    is fed are less ``a`` (clipped into the chunk), and a hidden output's positions whose id
    lies outside are zeroed. A step of ``tokens`` may be several ids (a prompt's next part);
    ``window``: the runnable may carry :func:`head_over_every_position`'s trailing output, whose
    rows of the last step are then the ``logits``."""
    caches: dict[int, np.ndarray] = {}
    for position, spec in enumerate(block["inputs"]):
        if spec["kind"] == "cache":
            index = int(spec["index"])
            caches[index] = np.zeros(
                shapes[index], dtype=fact_dtype(runnable.input_fact(position), dtypes[index])
            )
    step_ids = np.ascontiguousarray(prompt, dtype=np.int64)
    done = 0
    found: dict[str, list[np.ndarray]] = {}
    for token in tokens:
        count = int(step_ids.shape[1])
        feed = []
        outside = None
        for spec in block["inputs"]:
            if spec["kind"] == "ids" and rows is not None:
                outside = ((step_ids < rows[0]) | (step_ids >= rows[1])).reshape(-1)
                feed.append(np.clip(step_ids - rows[0], 0, rows[1] - rows[0] - 1))
            elif spec["kind"] == "ids":
                feed.append(step_ids)
            elif spec["kind"] == "cache":
                feed.append(caches[int(spec["index"])])
            else:  # hidden (a layer's output, by index) or carried (a value, by name)
                value = hidden[spec["index"]][done : done + count][None]
                feed.append(np.ascontiguousarray(value.astype(spec["dtype"])))
        outputs = [t.to_numpy() for t in runnable.run(feed)]
        if window and len(outputs) == len(block["outputs"]) + 1:
            every = outputs.pop()  # the last step's rows are the scored window's
            found["logits"] = [every.reshape(-1, every.shape[-1]).astype(np.float32)]
        done += count
        for index, cache in caches.items():  # past length grows for the shape-only ones
            shape = list(cache.shape)
            shape[2] = done
            caches[index] = np.zeros(shape, dtype=cache.dtype)
        for spec, value in zip(block["outputs"], outputs, strict=True):
            if spec["kind"] == "cache":
                caches[int(spec["index"])] = value
            elif spec["kind"] in ("hidden", "carried"):
                value = value.reshape(-1, value.shape[-1]).astype(np.float32)
                if outside is not None:
                    value[outside] = 0.0
                found.setdefault(f"{spec['kind']}_{spec['index']}", []).append(value)
            elif not window:
                found.setdefault("logits", []).append(_last_position(value))
        step_ids = np.asarray(token, dtype=np.int64).reshape(1, -1)
    return found


Steps = dict[str, list[np.ndarray]]
Run = Callable[..., Steps]
"""``_block_steps`` bound to all but the runnable and the rows (keywords)."""


def _piece_runs(
    work: Path,
    block: dict[str, Any],
    runs: Sequence[Run],
    peaks: list[int],
    load: Callable[[Path], Any] = load_runnable,
) -> list[Steps]:
    """Each of ``runs`` (:func:`_block_steps` of one input) on one block, loaded once
    (``VmHWM`` reset first), or on each of its chunks in turn when it runs in chunks of a
    matrix's rows: the head's logits laid side by side, as a matrix's product (``join``
    ``concat``), the lookup's rows summed (each position's row comes from the one chunk
    holding its id, zeros from the others).
    Appends the block's peak RSS to ``peaks``."""
    parts = block.get("chunks") or [{"directory": block["directory"]}]
    merged: list[Steps] = [{} for _ in runs]
    peak = 0
    for part in parts:
        _reset_hwm()
        runnable = load(work / part["directory"])
        rows = (int(part["begin"]), int(part["end"])) if "begin" in part else None
        for into, run in zip(merged, runs, strict=True):
            for key, steps in run(runnable=runnable, rows=rows).items():
                if key not in into:
                    into[key] = steps
                elif key == "logits" or block.get("join") == "concat":  # columns side by side
                    into[key] = [
                        np.concatenate([a, b], axis=-1)
                        for a, b in zip(into[key], steps, strict=True)
                    ]
                else:
                    into[key] = [a + b for a, b in zip(into[key], steps, strict=True)]
        del runnable
        peak = max(peak, _vm_hwm())
    peaks.append(peak)
    return merged


def run_layerwise(work: Path, request: dict[str, np.ndarray]) -> dict[str, Any]:
    """Run every block of ``work/blocks.json`` over the teacher-forced decode, one at a time,
    each fed PyTorch's output of the layer before it (``request["hidden"]``)."""
    import json

    blocks = json.loads((work / "blocks.json").read_text())
    dtypes = [str(d) for d in request["cache_dtypes"]]
    shapes = [[int(d) for d in shape] for shape in request["cache_shapes"]]
    saved: dict[str, Any] = {}
    peaks: list[int] = []
    # PyTorch's layer outputs; index -1 (the embedding lookup's) is tract's own, once run
    hidden: dict[int | str, Any] = dict(enumerate(request["hidden"]))
    for block in blocks:
        run: Run = functools.partial(
            _block_steps, block=block, prompt=request["prompt"], tokens=request["tokens"],
            hidden=hidden, shapes=shapes, dtypes=dtypes,
        )  # fmt: skip
        (found,) = _piece_runs(work, block, [run], peaks)
        for key, parts in found.items():
            saved[key] = np.concatenate(parts) if key != "logits" else np.stack(parts)
        for key in found:  # tract's own values, fed to the blocks after: the lookup's, carried
            if key == "hidden_-1" or key.startswith("carried_"):
                hidden[_fed_key(key)] = saved.pop(key)
    saved["block_peak_rss_bytes"] = np.asarray(peaks, dtype=np.int64)
    saved["peak_rss_bytes"] = np.asarray(max(peaks, default=0), dtype=np.int64)
    return saved


def run_layerwise_chunks(work: Path, request: dict[str, np.ndarray]) -> dict[str, Any]:
    """:func:`run_chunks`'s logits from the blocks of ``work/blocks.json``, one block loaded at
    a time: each block runs every chunk's decode fed the previous block's outputs (tract's own,
    never PyTorch's), so the head's logits are the archive's end to end while tract holds one
    block's weights.

    Where the head's block slices the last position (:func:`head_over_every_position`), each
    block runs each chunk in two runs instead, up to the window then the window at once through
    the block's KV cache, the head's statements copied onto every position (the copy in a
    sibling directory of hard links): two runs of a block a chunk, not one a scored position.
    ``scored_by`` says which ran."""
    import json

    blocks = json.loads((work / "blocks.json").read_text())
    dtypes = [str(d) for d in request["cache_dtypes"]]
    shapes = [[int(d) for d in shape] for shape in request["cache_shapes"]]
    first, last = int(request["first"]), int(request["last"])
    chunks = np.asarray(request["chunks"], dtype=np.int64)
    carried: list[dict[int | str, np.ndarray]] = [{} for _ in chunks]
    logits: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * len(chunks)
    peaks: list[int] = []
    copies = _heads_over_every_position(work, blocks)
    prefill = bool(copies)
    load = functools.partial(_load_every_position, copies)
    for number, block in enumerate(blocks):
        runs: list[Run] = [
            functools.partial(
                _block_steps, block=block, hidden=fed, shapes=shapes, dtypes=dtypes,
                window=prefill, **_window_steps(chunk, first, last, prefill),
            )
            for chunk, fed in zip(chunks, carried, strict=True)
        ]  # fmt: skip
        for c, found in enumerate(_piece_runs(work, block, runs, peaks, load)):
            for key, parts in found.items():
                if key == "logits":
                    rows = [p.reshape(-1, p.shape[-1]) for p in parts]
                    logits[c] = np.concatenate(rows).astype(np.float32)
                else:
                    carried[c][_fed_key(key)] = np.concatenate(parts)
            later = {spec["index"] for b in blocks[number + 1 :] for spec in b["inputs"]
                     if spec["kind"] in ("hidden", "carried")}  # fmt: skip
            carried[c] = {k: v for k, v in carried[c].items() if k in later}
    return {
        "scored_by": np.asarray("prefill" if prefill else "steps"),
        "logits": np.stack(logits),
        "block_peak_rss_bytes": np.asarray(peaks, dtype=np.int64),
        "peak_rss_bytes": np.asarray(max(peaks, default=0), dtype=np.int64),
    }


def _fed_key(key: str) -> int | str:
    """The key a saved output is fed to a later block by: a layer's index (``hidden_3``), or
    a carried value's name (``carried_<name>``)."""
    kind, _, index = key.partition("_")
    return int(index) if kind == "hidden" else index


def _window_steps(chunk: np.ndarray, first: int, last: int, prefill: bool) -> dict[str, Any]:
    """The steps giving a chunk's scored positions ``[first, last)``: the prompt up to
    ``first``, then the window at once (``prefill``; the trailing step is never fed), else up
    to ``first`` inclusive and one position a step (as :func:`run_chunks`)."""
    if prefill:
        return {"prompt": chunk[None, :first], "tokens": [chunk[first:last], chunk[last:last]]}
    return {"prompt": chunk[None, : first + 1], "tokens": chunk[first + 1 : last + 1]}


def _heads_over_every_position(work: Path, blocks: Sequence[dict[str, Any]]) -> dict[Path, Path]:
    """For each directory of a block giving logits (the head, or each of its vocabulary
    chunks), a sibling directory with the same ``.dat`` files (hard links) and
    :func:`head_over_every_position`'s graph; empty when any such graph has no slice to copy
    (every block then runs one position a step)."""
    directories = [
        work / part["directory"]
        for block in blocks
        if any(spec["kind"] == "logits" for spec in block["outputs"])
        for part in block.get("chunks") or [{"directory": block["directory"]}]
    ]
    edited = {d: head_over_every_position((d / "graph.nnef").read_text()) for d in directories}
    if not directories or any(graph is None for graph in edited.values()):
        return {}
    copies = {}
    for directory, graph in edited.items():
        copy = directory.with_name(directory.name + ALL_POSITIONS_SUFFIX)
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for entry in directory.iterdir():
            if entry.name != "graph.nnef":
                os.link(entry, copy / entry.name)
        (copy / "graph.nnef").write_text(graph or "")
        copies[directory] = copy
    return copies


def _load_every_position(copies: dict[Path, Path], directory: Path) -> Any:
    """The block at ``directory``, or its copy with the head over every position."""
    return load_runnable(copies.get(directory, directory))


# --- layer outputs, to say where a mismatch starts ----------------------------------------------

def load_with_layer_outputs(archive: Path, work: Path) -> tuple[Any, list[str]]:
    """tract's runnable of ``archive`` with every layer's output as an extra trailing output,
    and those variables' names. The archive is unpacked into ``work`` (the graph is text)."""
    import tarfile

    unpacked = work / "layers.nnef"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    graph_path = unpacked / "graph.nnef"
    graph = graph_path.read_text()
    names = layer_outputs(graph)
    graph_path.write_text(expose_layer_outputs(graph, names))
    return load_runnable(unpacked), names


def compare(found: np.ndarray, expected: np.ndarray, tol: ApproximationBounds) -> str | None:
    """None when ``found`` is close enough to ``expected``, else a one-line reason."""
    if found.shape != expected.shape:
        return f"shape {found.shape} != expected {expected.shape}"
    if found.size == 0:
        return None
    a = found.astype(np.float64)
    b = expected.astype(np.float64)
    bad = np.abs(a - b) > tol.atol + tol.rtol * np.abs(b)
    allowed = int(tol.outliers * b.size)
    if int(bad.sum()) > allowed:
        return f"{int(bad.sum())} elements out of tolerance, max abs diff {np.abs(a - b).max():g}"
    return None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tract", add_help=True)
    parser.add_argument("--version", action="store_true")
    parser.add_argument("model", nargs="?")
    for flag in (
        "--nnef-tract-core",
        "--nnef-tract-pulse",
        "--nnef-tract-extra",
        "--nnef-tract-transformers",
    ):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("-O", dest="optimize", action="store_true")
    parser.add_argument("command", nargs="?")
    parser.add_argument("--input-from-bundle", type=Path)
    parser.add_argument("--assert-output-bundle", type=Path)
    parser.add_argument("--save-outputs-npz", type=Path)
    parser.add_argument("--allow-float-casts", action="store_true")
    parser.add_argument("--approx", default="exact", choices=sorted(APPROXIMATION_BOUNDS))
    parser.add_argument(
        "--layer-outputs", type=Path, help="decode: also save each layer's output (work dir)"
    )
    return parser.parse_intermixed_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; the exit status and ``ERROR`` lines on stderr mimic the real CLI."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.version:
        print(f"tract {tract_version()}")
        return 0
    if (
        args.model is None
        or args.command not in ("run", "decode", "layerwise", "logits", "layerwise-logits")
        or args.input_from_bundle is None
    ):
        print(
            "ERROR unsupported invocation (only --version, run, decode, layerwise, logits and "
            "layerwise-logits)",
            file=sys.stderr,
        )
        return 2
    if args.command == "logits":
        if args.save_outputs_npz is None:
            print("ERROR logits needs --save-outputs-npz", file=sys.stderr)
            return 2
        with np.load(args.input_from_bundle) as bundle:
            request = {k: bundle[k] for k in bundle.files}
        logits = run_chunks(load_runnable(Path(args.model)), request)
        np.savez(args.save_outputs_npz, logits=logits, scored_by=np.asarray("steps"))
        return 0
    with np.load(args.input_from_bundle) as bundle:
        inputs = {k: bundle[k] for k in bundle.files}
    if args.command in ("layerwise", "layerwise-logits"):
        if args.save_outputs_npz is None:
            print(f"ERROR {args.command} needs --save-outputs-npz", file=sys.stderr)
            return 2
        run = run_layerwise if args.command == "layerwise" else run_layerwise_chunks
        np.savez(args.save_outputs_npz, **run(Path(args.model), inputs))
        return 0
    if args.command == "decode":
        if args.save_outputs_npz is None:
            print("ERROR decode needs --save-outputs-npz", file=sys.stderr)
            return 2
        if args.layer_outputs is not None:
            runnable, names = load_with_layer_outputs(Path(args.model), args.layer_outputs)
            logits, layers = run_decode(runnable, inputs, extra_outputs=len(names))
            saved: dict[str, Any] = {"logits": logits, "names": np.asarray(names)}
            if layers is not None:
                saved["layers"] = layers
            np.savez(args.save_outputs_npz, **saved)
        else:
            runnable = load_runnable(Path(args.model))
            logits, _ = run_decode(runnable, inputs)
            both: dict[str, Any] = {"logits": logits}
            if "chunks" in inputs:  # the fixed text's check too, on the archive loaded once
                both["chunk_logits"] = run_chunks(runnable, inputs)
                both["scored_by"] = np.asarray("steps")
            np.savez(args.save_outputs_npz, **both)
        return 0
    runnable = load_runnable(Path(args.model))
    outputs = run_bundle(runnable, inputs)
    if args.save_outputs_npz is not None:
        named: dict[str, Any] = {f"output_{i}": o for i, o in enumerate(outputs)}
        np.savez(args.save_outputs_npz, **named)
    if args.assert_output_bundle is not None:
        tol = APPROXIMATION_BOUNDS[args.approx]
        with np.load(args.assert_output_bundle) as bundle:
            expected = [bundle[k] for k in bundle.files]
        if len(expected) != len(outputs):
            print(f"ERROR {len(outputs)} outputs, expected {len(expected)}", file=sys.stderr)
            return 1
        for i, (found, want) in enumerate(zip(outputs, expected, strict=True)):
            reason = compare(found, want, tol)
            if reason is not None:
                print(f"ERROR output {i}: {reason}", file=sys.stderr)
                return 1
    return 0


def write_launcher(directory: Path) -> Path:
    """Write an executable ``tract`` script running this module with the current interpreter.

    torch-to-nnef runs the CLI by path with ``subprocess`` (twice per export just for
    ``--version``); the launcher pins the interpreter (the job's venv) and runs this file
    directly, without importing the ``service`` package: Python puts the script's directory
    first on ``sys.path``, where it finds ``graph_text`` (no module there has the name of one
    the child imports: tests/unit/exporters/nnef/test_nnef.py).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tract"
    script = Path(__file__).resolve()
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


if __name__ == "__main__":  # pragma: no cover - exercised through the launcher
    os.environ.setdefault("RUST_LOG", "error")
    sys.exit(main())
