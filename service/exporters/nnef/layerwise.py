"""The shipped NNEF archive cut at its decoder blocks, so tract can check it one block at a time.

tract holds every weight of the archive it loads in RAM. When the whole archive does not fit the
memory a verification may use (``MODELPREP_TRACT_MAX_MEMORY``), the archive is checked block by
block instead: the graph the job ships (``graph.nnef``, text) is cut at the layer boundaries that
:func:`~service.exporters.nnef.tract_cli.layer_outputs` finds, and each piece becomes a small
NNEF directory tract loads on its own:

* ``block-000``: ``input_ids`` (and layer 0's KV cache) -> layer 0's output and cache (the
  embedding lookup, scaled where the model scales it, stays in this block: nothing to feed);
* ``block-i``: layer ``i-1``'s output, as PyTorch computed it, -> layer ``i``'s output and cache;
* the last block: the last layer's output -> the logits (final norm and output head).

A piece is the backward closure of its outputs over the shipped graph's own statements, stopped
at every layer boundary (a boundary it reaches becomes an external input, fed PyTorch's value):
its statements are the shipped ones verbatim and its ``.dat`` files are hard links to the files
unpacked from the shipped archive, so what tract runs is the artifact's graph and its numbers,
never a re-export. Graph inputs a piece reaches only for their shape (layer 0's cache gives the
past length to every layer's positions) are fed zeros of the right shape by the child.

The child (``tract_cli.py WORK layerwise``) runs the pieces one after the other, each over the
same teacher-forced decode as the whole check (the prompt, then one token a step, feeding back
the piece's own KV cache), and frees each before loading the next: its peak is one block's
weights, not the model's. ``blocks.json`` in the work directory lists the pieces for it.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import VerificationFailed
from service.exporters.common.parity import ParityReport, Tolerance, compare_outputs
from service.exporters.nnef import tract_cli

if TYPE_CHECKING:
    from service.exporters.common.reference import GreedyReference
    from service.exporters.nnef.verify import IOSpec

_HEADER = re.compile(r"^graph (\w+)\((.*?)\) -> \((.*?)\)\s*$", re.MULTILINE)
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
_VARIABLE = re.compile(r"variable\s*<\s*\w+\s*>\s*\(\s*label\s*=\s*'([^']*)'")

NNEF_DTYPES = {"float16": "f16", "float32": "f32"}
"""Activation dtypes a boundary can be fed in (numpy has no bfloat16)."""
NUMPY_DTYPES = {v: k for k, v in NNEF_DTYPES.items()}


@dataclass(frozen=True)
class Statement:
    defines: tuple[str, ...]
    uses: frozenset[str]
    text: str
    label: str | None
    """The tensor file (``label``.dat) of a ``variable`` statement."""


@dataclass(frozen=True)
class Graph:
    """A torch-to-nnef ``graph.nnef``: what comes before the graph (fragments, extensions),
    its inputs and outputs, and its statements in order."""

    prelude: str
    name: str
    inputs: list[str]
    outputs: list[str]
    statements: list[Statement]

    @property
    def defined(self) -> dict[str, Statement]:
        return {n: s for s in self.statements for n in s.defines}


def parse_graph(text: str) -> Graph:
    """Read ``graph.nnef`` as a list of statements (torch-to-nnef writes one per line)."""
    header = _HEADER.search(text)
    if header is None:
        raise VerificationFailed("no graph declaration in the archive's graph.nnef")
    body = text[header.end() :]
    open_at, close_at = body.index("{"), body.rindex("}")
    lines = [line.strip() for line in body[open_at + 1 : close_at].split(";")]
    statements = []
    for line in lines:
        if not line:
            continue
        lhs, _, rhs = line.partition("=")
        defines = tuple(_NAME.findall(lhs))
        label = _VARIABLE.search(rhs)
        uses = frozenset(_NAME.findall(_STRING.sub("", rhs)))
        statements.append(Statement(defines, uses, line, label.group(1) if label else None))
    names = {n for s in statements for n in s.defines}
    statements = [
        Statement(s.defines, frozenset(s.uses & names), s.text, s.label) for s in statements
    ]
    split = [n.strip() for n in header.group(2).split(",") if n.strip()]
    outs = [n.strip() for n in header.group(3).split(",") if n.strip()]
    return Graph(text[: header.start()], header.group(1), split, outs, statements)


@dataclass
class Block:
    """One piece of the graph: what the child feeds it and what it compares."""

    name: str
    directory: str
    inputs: list[dict[str, object]]
    """In graph order: ``{"name", "kind": "ids"|"cache"|"hidden", "index"}`` (the cache's
    position among the graph's caches, the layer whose output a hidden input is; a hidden
    input's numpy ``dtype`` too)."""
    outputs: list[dict[str, object]]
    """In graph order: ``{"name", "kind": "hidden"|"cache"|"logits", "index"}``."""
    weight_bytes: int = 0
    weights: list[str] = field(default_factory=list)


def _closure(graph: Graph, outputs: Sequence[str], cuts: set[str]) -> tuple[set[str], set[str]]:
    """The statements' names computing ``outputs``, and the cut values they reach."""
    defined = graph.defined
    needed: set[str] = set()
    reached: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in needed or name in reached:
            continue
        if name in cuts and name not in outputs:
            reached.add(name)
            continue
        needed.add(name)
        statement = defined.get(name)
        if statement is not None:
            stack.extend(statement.uses)
    return needed, reached


def _external(name: str, shape: str, dtype: str) -> str:
    return f"{name} = tract_core_external(shape = [{shape}], datum_type = '{dtype}')"


def cut_blocks(graph: Graph, unpacked: Path, work: Path, hidden: int, dtype: str) -> list[Block]:
    """Write one NNEF directory per block under ``work`` (see the module docstring) and
    return them in order. ``unpacked`` holds the shipped archive's files; ``hidden`` and
    ``dtype`` (``f16``/``f32``) describe a boundary fed to a block."""
    layers = tract_cli.layer_outputs(_render(graph))
    caches_in = [n for n in graph.inputs[1:]]
    caches_out = graph.outputs[1:]
    if not layers or len(caches_out) != 2 * len(layers) or len(caches_in) != len(caches_out):
        raise VerificationFailed(
            f"the archive's graph cannot be cut at its layers ({len(layers)} layer outputs "
            f"found for {len(caches_out)} caches)"
        )
    cuts = set(layers)
    pieces: list[tuple[str, list[str]]] = [
        (f"layer {i}", [layers[i], caches_out[2 * i], caches_out[2 * i + 1]])
        for i in range(len(layers))
    ]
    pieces.append(("head", [graph.outputs[0]]))
    kinds = {layers[i]: ("hidden", i) for i in range(len(layers))}
    kinds |= {n: ("cache", i) for i, n in enumerate(caches_out)}
    kinds[graph.outputs[0]] = ("logits", 0)
    in_kinds = {graph.inputs[0]: ("ids", 0)} | {n: ("cache", i) for i, n in enumerate(caches_in)}
    blocks = []
    for index, (label, outputs) in enumerate(pieces):
        needed, reached = _closure(graph, outputs, cuts)
        directory = work / f"block-{index:03d}"
        directory.mkdir(parents=True)
        # tract numbers a graph's inputs in the order their externals are declared: the
        # boundaries first (declared first), then the graph's own inputs.
        fed = sorted(reached, key=lambda n: kinds[n][1])
        inputs = fed + [n for n in graph.inputs if n in needed]
        body = [_external(n, f"1, S, {hidden}", dtype) for n in fed]
        weights = []
        for statement in graph.statements:
            if not needed.intersection(statement.defines):
                continue
            body.append(statement.text)
            if statement.label is not None:
                weights.append(statement.label)
        size = 0
        for label_name in weights:
            source = unpacked / f"{label_name}.dat"
            os.link(source, directory / source.name)
            size += source.stat().st_size
        header = f"graph {graph.name}({', '.join(inputs)}) -> ({', '.join(outputs)})"
        text = graph.prelude + header + "\n{\n" + "".join(f"    {s};\n" for s in body) + "}\n"
        (directory / "graph.nnef").write_text(text)
        blocks.append(
            Block(
                name=label,
                directory=directory.name,
                inputs=[{"name": n, "kind": "hidden", "index": kinds[n][1],
                         "dtype": NUMPY_DTYPES[dtype]} for n in fed]
                + [{"name": n, "kind": in_kinds[n][0], "index": in_kinds[n][1]}
                   for n in inputs[len(fed):]],
                outputs=[{"name": n, "kind": kinds[n][0], "index": kinds[n][1]} for n in outputs],
                weight_bytes=size,
                weights=weights,
            )
        )  # fmt: skip
    (work / "blocks.json").write_text(json.dumps([asdict(b) for b in blocks], indent=1))
    return blocks


def _render(graph: Graph) -> str:
    header = f"graph {graph.name}({', '.join(graph.inputs)}) -> ({', '.join(graph.outputs)})"
    return header + "\n{\n" + "".join(f"    {s.text};\n" for s in graph.statements) + "}\n"


def unpack(archive: Path, into: Path) -> Graph:
    """Unpack the shipped archive into ``into`` (streamed to disk, never held in memory) and
    parse its graph."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return parse_graph((into / "graph.nnef").read_text())


def verify_causal_lm_layerwise(
    archive: Path,
    io: IOSpec,
    expected: GreedyReference,
    atol: float,
    rtol: float,
    *,
    work: Path,
    check_abort: Callable[[], None] | None = None,
) -> ParityReport:
    """The whole check's decode, block by block: each layer's output against PyTorch's within
    ``atol + rtol * max|layer|`` (as the divergence report judges a layer), and the head's
    logits within the whole check's own tolerance (``atol + rtol * max|logits|``)."""
    import numpy as np

    from service.exporters.nnef.verify import decode_request, run_tract

    if expected.hidden is None:
        raise VerificationFailed("the layer-by-layer check needs every layer's output recorded")
    dtype = NNEF_DTYPES.get(io.inputs[1].dtype) if len(io.inputs) > 1 else None
    if dtype is None:
        raise VerificationFailed(
            f"tract cannot be fed {io.inputs[1].dtype if len(io.inputs) > 1 else 'these'} "
            "activations block by block (float16 and float32 only)"
        )
    unpacked = work / "unpacked"
    graph = unpack(archive, unpacked)
    blocks = cut_blocks(graph, unpacked, work / "blocks", int(expected.hidden.shape[-1]), dtype)
    request = decode_request(io, expected) | {"hidden": expected.hidden}
    run = run_tract(work / "blocks", "layerwise", request, work / "run", check_abort)
    peaks = [int(p) for p in run.outputs.get("block_peak_rss_bytes", [])]
    figures: list[dict[str, object]] = []
    for index, block in enumerate(blocks):
        figure: dict[str, object] = {"block": block.name, "weight_bytes": block.weight_bytes}
        if index < len(peaks):
            figure["tract_peak_rss_bytes"] = peaks[index]
        figures.append(figure)
    for layer in range(expected.hidden.shape[0]):
        found = run.outputs.get(f"hidden_{layer}")
        want = expected.hidden[layer].astype(np.float64)
        if found is None or found.shape != want.shape:
            raise VerificationFailed(
                f"tract's block for layer {layer} gave {None if found is None else found.shape}"
                f", PyTorch's layer output is {want.shape}"
            )
        diff = float(np.abs(found.astype(np.float64) - want).max(initial=0.0))
        tol = atol + rtol * float(np.abs(want).max(initial=0.0))
        figures[layer] |= {"max_abs_err": diff, "tolerance": tol}
        if not diff <= tol:  # NaN fails too
            raise VerificationFailed(
                f"tract's block for {expected.layer_names[layer]} differs from PyTorch by "
                f"{diff:.3g} (tolerance {tol:.3g}), fed PyTorch's input to that layer "
                "(layer-by-layer check)"
            )
    logits = list(run.outputs["logits"])
    comparison = compare_outputs(logits, expected.logits, Tolerance(atol, rtol))
    figures[-1] |= {"max_abs_err": comparison.max_abs_error, "tolerance": comparison.tolerance}
    problem = comparison.unjudgeable("tract")
    if problem is not None:
        raise VerificationFailed(f"{problem} (layer-by-layer check)")
    if not comparison.passed:
        raise VerificationFailed(
            f"tract logits differ from PyTorch by {comparison.max_abs_error:.3g} (tolerance "
            f"{comparison.tolerance:.3g}) fed PyTorch's last layer output; every layer's block "
            "agrees: the divergence is in the final norm or output head (layer-by-layer check)"
        )
    agreed = [int(np.argmax(f)) == t for f, t in zip(logits, expected.tokens, strict=True)]
    return ParityReport.of(
        "tract", comparison, len(logits), expected.tokens, agreed,
        peak_rss_bytes=run.peak_rss_bytes,
        extra={"mode": "layerwise", "blocks": figures},
    )  # fmt: skip
