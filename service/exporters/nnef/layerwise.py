"""The shipped NNEF archive cut at its decoder blocks, so tract can check it one block at a time.

tract holds every weight of the archive it loads in RAM. When the whole archive does not fit the
memory a verification may use (``MODELPREP_TRACT_MAX_MEMORY``), the archive is checked block by
block instead: the graph the job ships (``graph.nnef``, text) is cut at the layer boundaries that
:func:`~service.exporters.nnef.graph_text.layer_outputs` finds, and each piece becomes a small
NNEF directory tract loads on its own:

* ``embedding``: ``input_ids`` -> the embedding lookup (``tract_core_gather`` of the
  embedding matrix by the ids), where the graph has one; its output is fed, as tract computed
  it, to layer 0, whose comparison with PyTorch's layer 0 output checks it (else the lookup stays
  in layer 0's block);
* ``layer i``: layer ``i-1``'s output, as PyTorch computed it (layer 0: the lookup's), -> layer
  ``i``'s output and cache;
* ``head``: the last layer's output -> the logits (final norm and output head).

A vocabulary matrix (the embedding, the head) outweighs a decoder layer at a large vocabulary
(float32 49152 x 4096: 0.75 GiB, a layer of that model 0.75 GiB too, and both in one block
before). The embedding and head blocks therefore run in chunks of the matrix's rows, each at
most :func:`vocab_chunk_bytes` (the largest layer's weight bytes, at least
:data:`MIN_VOCAB_CHUNK_BYTES`): a chunk's weight file holds the shipped file's rows ``[a, b)``
byte for byte under a header naming ``b - a`` rows, and its graph is the block's own with that
variable's shape changed. The head's chunks give the logits' columns ``[a, b)``, laid side by
side; the lookup's chunk is fed the ids less ``a`` (clipped) and gives the rows of the positions
whose id lies in ``[a, b)``, the others zeroed and summed away. The numbers tract runs are still
the shipped archive's, its whole matrix read once, a chunk at a time. A matrix is chunked only
where the block's statements treat rows apart (a ``tract_core_gather`` on axis 0, or
``unsqueeze`` into a ``linear`` giving the block's output) and its file is plain float32 or
float16; any other stays whole.

Below a layer (``MODELPREP_TRACT_BLOCK_BYTES``, :func:`cut_blocks`' ``block_bytes``): a layer
whose weights outweigh the block is cut at its attention's output (the first value past which the
layer reads no attention weight: the residual sum, or the attention's own output where the
residual is parallel) into ``layer i attention`` and ``layer i mlp``; a piece still heavier loses
its largest matrices, one at a time, each product ``linear(x, W)`` becoming a block of its own
(``layer i mlp.down_proj rows``) fed ``x``, run in chunks of ``W``'s rows (output features) as the
head is, their columns laid side by side; what computes ``x`` becomes a piece of its own where
nothing else gives it (``layer i mlp to down_proj``). Those boundaries inside a layer are fed as
tract computed them (``carried``), like the lookup's, so a layer's blocks compose the layer's own
statements and its output is judged against PyTorch's, fed PyTorch's input to the layer, exactly
as a whole layer's block is; the largest block is then the setting, whatever the width. A
matrix with a bias of its own stays whole (its bias is not cut).

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

Why one module of over 450 lines: the cut (each piece's closure over the shipped statements, its
boundaries, below a layer too) and the chunking of a matrix (its rows, its ``.dat`` header, the block's
graph with that shape changed) both read and rewrite the same parsed graph (:class:`Graph`), and
a chunk is a kind of block; the child that runs them is apart (``tract_cli``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import VerificationFailed
from service.exporters.nnef import graph_text
from service.exporters.nnef.plan import MIN_VOCAB_CHUNK_BYTES
from service.verification.parity import ParityReport, Tolerance, compare_outputs

if TYPE_CHECKING:
    from service.exporters.nnef.verify import IOSpec
    from service.verification.reference import GreedyReference

_HEADER = re.compile(r"^graph (\w+)\((.*?)\) -> \((.*?)\)\s*$", re.MULTILINE)
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
_VARIABLE = re.compile(r"variable\s*<\s*\w+\s*>\s*\(\s*label\s*=\s*'([^']*)'")
_SHAPE = re.compile(r"shape\s*=\s*\[([^\]]*)\]")
_OPERATOR = re.compile(r"^\s*(\w+)\s*\(")
_DATUM_TYPE = re.compile(r"(?:datum_type|\bto)\s*=\s*'(\w+)'")

DAT_HEADER_BYTES = 128
"""An NNEF tensor file's header (magic ``4E EF``, version, data length, rank, 8 dimensions,
bits per item, item type), then the data, row-major."""

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

    @functools.cached_property
    def defined(self) -> dict[str, Statement]:
        """Each name's statement; built once (the cut asks for it per closure, and a 70B
        graph has tens of thousands of statements)."""
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
    """The most weight bytes tract holds at once for this block (one chunk's, when chunked)."""
    weights: list[str] = field(default_factory=list)
    chunks: list[dict[str, object]] = field(default_factory=list)
    """When the block runs in chunks of a matrix's rows (module doc):
    ``{"directory", "begin", "end"}`` each, in order; ``directory`` is then unused."""
    join: str = "sum"
    """How the chunks' hidden outputs join: ``sum`` (the lookup's rows, zeros elsewhere) or
    ``concat`` (a matrix's product, its columns side by side, as the head's logits)."""


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


def cut_blocks(
    graph: Graph,
    unpacked: Path,
    work: Path,
    hidden: int,
    dtype: str,
    block_bytes: int | None = None,
) -> list[Block]:
    """Write one NNEF directory per block under ``work`` (see the module docstring) and
    return them in order. ``unpacked`` holds the shipped archive's files; ``hidden`` and
    ``dtype`` (``f16``/``f32``) describe a boundary fed to a block. ``block_bytes``: the most
    weight bytes a block may hold (``MODELPREP_TRACT_BLOCK_BYTES``); a layer above it is cut
    into its attention and MLP, and a matrix still above it into blocks of its rows (module
    doc); None: whole layers."""
    layers = graph_text.layer_outputs(_render(graph))
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
    kinds: dict[str, tuple[str, int | str]] = {
        layers[i]: ("hidden", i) for i in range(len(layers))
    }
    lookup = _embedding_lookup(graph)
    if lookup is not None:  # index -1: the input to layer 0, fed tract's own value
        cuts.add(lookup.defines[0])
        pieces.insert(0, ("embedding", [lookup.defines[0]]))
        kinds[lookup.defines[0]] = ("hidden", -1)
    variables = {s.defines[0]: s for s in graph.statements if s.label is not None and s.defines}
    chunk_bytes = vocab_chunk_bytes(graph, unpacked, layers, cuts)
    widths: dict[str, str] = {}
    if block_bytes is not None:
        chunk_bytes = min(chunk_bytes, block_bytes)
        pieces = _below_layers(
            graph, unpacked, pieces, cuts, kinds, variables, block_bytes, widths
        )
    kinds |= {n: ("cache", i) for i, n in enumerate(caches_out)}
    kinds[graph.outputs[0]] = ("logits", 0)
    in_kinds = {graph.inputs[0]: ("ids", 0)} | {n: ("cache", i) for i, n in enumerate(caches_in)}
    order = {n: i for i, s in enumerate(graph.statements) for n in s.defines}
    blocks = []
    for index, (label, outputs) in enumerate(pieces):
        needed, reached = _closure(graph, outputs, cuts)
        directory = work / f"block-{index:03d}"
        directory.mkdir(parents=True)
        # tract numbers a graph's inputs in the order their externals are declared: the
        # boundaries first (declared first, in graph order), then the graph's own inputs.
        fed = sorted(reached, key=lambda n: order.get(n, -1))
        inputs = fed + [n for n in graph.inputs if n in needed]
        fed_dtypes = {n: _fed_dtype(graph, n, dtype) for n in fed}
        body = [_external(n, f"1, S, {widths.get(n) or hidden}", fed_dtypes[n]) for n in fed]
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
        chunks: list[dict[str, object]] = []
        rows = kinds[outputs[0]][0] == "carried" and label.endswith(ROWS_SUFFIX)
        if label in ("embedding", "head") or rows:
            limit = block_bytes if rows and block_bytes is not None else chunk_bytes
            matrix = _chunkable(graph, needed, outputs, variables, unpacked, 0)
            if matrix is not None:  # a chunk's file (its header too) beside the other weights
                other = size - (unpacked / f"{matrix.label}.dat").stat().st_size
                limit = max(1, limit - other - DAT_HEADER_BYTES)
            matrix = _chunkable(graph, needed, outputs, variables, unpacked, limit)
            if matrix is not None:
                chunks, largest = _write_chunks(matrix, unpacked, directory, text, limit)
                size += largest - (unpacked / f"{matrix.label}.dat").stat().st_size
        fed_specs: list[dict[str, object]] = [
            {"name": n, "kind": _fed_kind(kinds[n]), "index": kinds[n][1],
             "dtype": NUMPY_DTYPES[fed_dtypes[n]]} for n in fed
        ]  # fmt: skip
        blocks.append(
            Block(
                name=label,
                directory=directory.name,
                inputs=fed_specs
                + [{"name": n, "kind": in_kinds[n][0], "index": in_kinds[n][1]}
                   for n in inputs[len(fed):]],
                outputs=[{"name": n, "kind": kinds[n][0], "index": kinds[n][1]} for n in outputs],
                weight_bytes=size,
                weights=weights,
                chunks=chunks,
                join="concat" if rows else "sum",
            )
        )  # fmt: skip
    (work / "blocks.json").write_text(json.dumps([asdict(b) for b in blocks], indent=1))
    return blocks


ROWS_SUFFIX = " rows"
"""The name of a block that is one matrix's product, run in blocks of its rows."""


def _fed_kind(kind: tuple[str, int | str]) -> str:
    """How the child feeds a boundary: PyTorch's layer output (``hidden`` of a layer >= 0), or
    tract's own value from the block that computed it (the lookup's, index -1, is ``hidden``
    too, for the child's earlier contract; a value inside a layer is ``carried``)."""
    return kind[0] if kind[0] == "hidden" else "carried"


def _matrix_shape(graph: Graph, product: str) -> list[str]:
    """The declared shape of the matrix a ``linear`` statement ``product`` multiplies by."""
    statement = graph.defined[product]
    operands = _NAME.findall(_STRING.sub("", statement.text.partition("(")[2]))
    current = graph.defined.get(operands[1]) if len(operands) > 1 else None
    while current is not None and current.label is None:
        current = graph.defined.get(_NAME.findall(current.text.partition("(")[2])[0])
    shape = _SHAPE.search(current.text.partition("=")[2]) if current is not None else None
    if shape is None:
        raise VerificationFailed(f"the matrix of {product} declares no shape")
    return dims_text(shape.group(1))


def _weight_bytes(graph: Graph, needed: set[str], unpacked: Path) -> dict[str, int]:
    """The weight files (by label) the statements ``needed`` read, and their bytes."""
    return {
        s.label: (unpacked / f"{s.label}.dat").stat().st_size
        for s in graph.statements
        if s.label is not None and needed.intersection(s.defines)
    }


_ATTENTION = re.compile(r"^(?!.*norm).*(attn|attention)", re.IGNORECASE)
"""An attention's weight: its label names ``attn``/``attention`` (``self_attn.q_proj``,
``attention.query_key_value``), not a norm (``post_attention_layernorm`` may follow it)."""


def _below_layers(
    graph: Graph,
    unpacked: Path,
    pieces: list[tuple[str, list[str]]],
    cuts: set[str],
    kinds: dict[str, tuple[str, int | str]],
    variables: dict[str, Statement],
    budget: int,
    widths: dict[str, str],
) -> list[tuple[str, list[str]]]:
    """``pieces`` with each layer heavier than ``budget`` cut at its attention's output (the
    first value past which no attention weight is read, :func:`_attention_output`), then each
    piece still heavier cut around its largest matrices, largest first, until it fits: each
    matrix's product becomes a block of its own (``<matrix> rows``, run in blocks of its rows
    where it alone outweighs the budget). The new boundaries join ``cuts``, ``kinds``
    (``carried``: fed as tract computed them) and ``widths`` (their last dimension). Pieces
    come back in an order where each runs after those it is fed by."""

    def carry(name: str, width: str) -> None:
        cuts.add(name)
        kinds[name] = ("carried", name)
        widths[name] = width

    split: list[tuple[str, list[str]]] = []
    for label, outputs in pieces:
        needed, _ = _closure(graph, outputs, cuts)
        heavy = sum(_weight_bytes(graph, needed, unpacked).values()) > budget
        middle = _attention_output(graph, outputs[0], cuts, needed, variables) if heavy else None
        if not label.startswith("layer ") or middle is None:
            split.append((label, outputs))
            continue
        carry(middle, widths.get(middle, "") or _product_width(graph, middle))
        split += [(f"{label} attention", [middle, *outputs[1:]]), (f"{label} mlp", outputs[:1])]
    done: list[tuple[str, list[str]]] = []
    queue = list(split)
    while queue:
        label, outputs = queue.pop(0)
        needed, _ = _closure(graph, outputs, cuts)
        sizes = _weight_bytes(graph, needed, unpacked)
        products = _products(graph, needed, variables, unpacked)
        if label in ("embedding", "head") or sum(sizes.values()) <= budget or not products:
            done.append((label, outputs))
            continue
        product, matrix = max(products, key=lambda p: sizes.get(p[1], 0))
        rows, columns = _matrix_shape(graph, product)[:2]
        left = _NAME.findall(_STRING.sub("", graph.defined[product].text.partition("(")[2]))[0]
        name = ".".join(matrix.removesuffix(".weight").split(".")[-2:])
        layer = " ".join(label.split(" ")[:2])
        done.append((f"{layer} {name}{ROWS_SUFFIX}", [product]))
        carry(product, rows)
        if product in outputs:  # the piece ended in the product: it now ends at its input
            carry(left, columns)
            queue.insert(0, (label, [left if o == product else o for o in outputs]))
            continue
        queue.insert(0, (label, outputs))
        if left not in cuts:  # what computes the product's input, apart, before it
            carry(left, columns)
            side = " ".join(label.split(" ")[:3])
            queue.insert(0, (f"{side} to {name.split('.')[-1]}", [left]))
    return _in_feeding_order(graph, done, cuts)


def _product_width(graph: Graph, name: str) -> str:
    """A boundary's last dimension where it is a matrix's product (its rows), else empty (the
    model's width)."""
    statement = graph.defined.get(name)
    return _matrix_shape(graph, name)[0] if statement and _operator(statement) == "linear" else ""


def _products(
    graph: Graph, needed: set[str], variables: dict[str, Statement], unpacked: Path
) -> list[tuple[str, str]]:
    """The ``linear`` products among ``needed`` whose matrix a block may run apart in blocks
    of its rows (:func:`_chunkable`'s test), as (product, matrix label)."""
    found = []
    for name in sorted(needed):
        statement = graph.defined.get(name)
        if statement is None or _operator(statement) != "linear":
            continue
        matrix = _chunkable(graph, needed, [name], variables, unpacked, 0)
        if matrix is not None and matrix.label is not None:
            found.append((name, matrix.label))
    return found


def _attention_output(
    graph: Graph, output: str, cuts: set[str], needed: set[str], variables: dict[str, Statement]
) -> str | None:
    """The first value of a layer (graph order) whose closure reads every attention weight of
    the layer (:data:`_ATTENTION`) and past which the layer's output reads
    none: where the layer is cut into its attention and its MLP. Works for a residual after
    the attention (the MLP block is fed the sum) and a parallel one (fed the layer's input
    too). None when the layer has no such value."""
    attention = {
        s.defines[0] for s in variables.values()
        if s.defines[0] in needed and s.label is not None and _ATTENTION.search(s.label)
    }  # fmt: skip
    if not attention:
        return None
    for statement in graph.statements:
        name = statement.defines[0] if statement.defines else None
        if name is None or name not in needed or name in cuts or statement.label is not None:
            continue
        reads, _ = _closure(graph, [name], cuts)
        if not attention <= reads:
            continue
        rest, _ = _closure(graph, [output], cuts | {name})
        if not attention & rest:
            return name
    return None


def _in_feeding_order(
    graph: Graph, pieces: list[tuple[str, list[str]]], cuts: set[str]
) -> list[tuple[str, list[str]]]:
    """``pieces`` ordered so that each comes after every piece computing a boundary it reads
    (ties in their order given)."""
    producer = {out: i for i, (_, outputs) in enumerate(pieces) for out in outputs}
    deps = []
    for _, outputs in pieces:
        _, reached = _closure(graph, outputs, cuts)
        deps.append({producer[n] for n in reached if n in producer})
    ordered: list[int] = []
    placed: set[int] = set()
    while len(ordered) < len(pieces):
        ready = next(
            (i for i in range(len(pieces)) if i not in placed and deps[i] <= placed), None
        )
        if ready is None:
            raise VerificationFailed("the archive's blocks feed each other in a cycle")
        ordered.append(ready)
        placed.add(ready)
    return [pieces[i] for i in ordered]


def _embedding_lookup(graph: Graph) -> Statement | None:
    """The statement looking the ids up in the embedding matrix (``tract_core_gather`` of a
    variable by the graph's first input), if the graph has one."""
    variables = {s.defines[0] for s in graph.statements if s.label is not None and s.defines}
    for statement in graph.statements:
        if (
            _operator(statement) == "tract_core_gather"
            and len(statement.defines) == 1
            and graph.inputs[0] in statement.uses
            and statement.uses & variables
        ):
            return statement
    return None


def _operator(statement: Statement) -> str | None:
    found = _OPERATOR.match(statement.text.partition("=")[2])
    return found.group(1) if found else None


def _fed_dtype(graph: Graph, name: str, default: str) -> str:
    """The dtype a boundary is fed in: its statement's own (the lookup's ``datum_type``, a cast's
    ``to``), else the caches'."""
    found = _DATUM_TYPE.search(graph.defined[name].text) if name in graph.defined else None
    return found.group(1) if found and found.group(1) in NUMPY_DTYPES else default


def _dat_dims(path: Path) -> tuple[int, ...]:
    """The dimensions in an NNEF tensor file's header; ``()`` for a file that is not a plain
    float16/float32 tensor (tract's own quantized formats keep their own layout)."""
    with open(path, "rb") as dat:
        head = dat.read(DAT_HEADER_BYTES)
    if len(head) < DAT_HEADER_BYTES or head[:2] != b"\x4e\xef":
        return ()
    rank = int.from_bytes(head[8:12], "little")
    bits, item_type = int.from_bytes(head[44:48], "little"), int.from_bytes(head[48:52], "little")
    if not 1 <= rank <= 8 or item_type != 0 or bits not in (16, 32):
        return ()
    dims = tuple(int.from_bytes(head[12 + 4 * i : 16 + 4 * i], "little") for i in range(rank))
    expected = bits // 8
    for dim in dims:
        expected *= dim
    if int.from_bytes(head[4:8], "little") != expected:
        return ()
    return dims


def vocab_chunk_bytes(graph: Graph, unpacked: Path, layers: Sequence[str], cuts: set[str]) -> int:
    """The most bytes of a vocabulary matrix's rows one chunk holds: the largest decoder layer's
    weight bytes (so a chunk never outweighs a layer), at least :data:`MIN_VOCAB_CHUNK_BYTES`."""
    largest = 0
    for index, layer in enumerate(layers):
        needed, _ = _closure(graph, [layer], cuts - {layer})
        labels = {s.label for s in graph.statements if s.label and needed & set(s.defines)}
        if index == 0:  # the embedding, when it stays in layer 0's block, is not the layer's
            lookup = _embedding_lookup(graph)
            if lookup is not None and lookup.defines[0] not in cuts:
                labels -= {graph.defined[n].label for n in lookup.uses if n in graph.defined}
        size = sum((unpacked / f"{label}.dat").stat().st_size for label in labels if label)
        largest = max(largest, size)
    return max(largest, MIN_VOCAB_CHUNK_BYTES)


def _chunkable(
    graph: Graph,
    needed: set[str],
    outputs: Sequence[str],
    variables: dict[str, Statement],
    unpacked: Path,
    chunk_bytes: int,
) -> Statement | None:
    """The vocabulary matrix of the embedding or head block that can run in chunks of its rows
    (module doc), if any: a plain float 2-D file larger than a chunk, whose every use in the
    block is row-wise."""
    defined = graph.defined
    users: dict[str, list[Statement]] = {}
    for name in needed:
        statement = defined.get(name)
        if statement is not None:
            for used in statement.uses:
                users.setdefault(used, []).append(statement)
    for name, variable in variables.items():
        if name not in needed or variable.label is None:
            continue
        path = unpacked / f"{variable.label}.dat"
        if len(_dat_dims(path)) != 2 or path.stat().st_size <= chunk_bytes:
            continue
        if _rowwise(name, users, outputs):
            return variable
    return None


def _rowwise(name: str, users: dict[str, list[Statement]], outputs: Sequence[str]) -> bool:
    """Whether every path from the matrix ``name`` is row-wise: a gather on axis 0 (the lookup),
    or ``unsqueeze`` on axis 0 into the right operand of a ``linear`` that is a block output."""
    found = users.get(name, [])
    if not found:
        return False
    for statement in found:
        op, text = _operator(statement), statement.text
        if op == "tract_core_gather" and re.search(r"axis\s*=\s*0\b", text):
            if _NAME.findall(text.partition("(")[2])[0] != name:
                return False
        elif op == "unsqueeze" and re.search(r"axes\s*=\s*\[\s*0\s*\]", text):
            if not _rowwise(statement.defines[0], users, outputs):
                return False
        elif op == "linear":
            operands = _NAME.findall(_STRING.sub("", text.partition("(")[2]))
            if len(operands) != 2 or operands[1] != name or statement.defines[0] not in outputs:
                return False
        else:
            return False
    return True


def _write_chunks(
    matrix: Statement, unpacked: Path, directory: Path, text: str, chunk_bytes: int
) -> tuple[list[dict[str, object]], int]:
    """Write the chunk directories of a block beside ``directory`` (module doc): its weight
    files linked, the matrix's rows ``[a, b)`` copied a buffer at a time (never whole in
    memory), its graph ``text`` with that variable's label and first dimension changed.
    Returns the chunks and the largest chunk file's bytes."""
    label = str(matrix.label)
    source = unpacked / f"{label}.dat"
    rows = _dat_dims(source)[0]
    row_bytes = (source.stat().st_size - DAT_HEADER_BYTES) // rows
    step = max(1, chunk_bytes // row_bytes)
    with open(source, "rb") as dat:
        header = dat.read(DAT_HEADER_BYTES)
    chunks: list[dict[str, object]] = []
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        part = directory.with_name(f"{directory.name}-{len(chunks):03d}")
        part.mkdir()
        for linked in directory.glob("*.dat"):
            if linked.name != source.name:
                os.link(linked, part / linked.name)
        name = f"{label}.rows-{begin}-{end}"
        patched = bytearray(header)
        patched[4:8] = ((end - begin) * row_bytes).to_bytes(4, "little")
        patched[12:16] = (end - begin).to_bytes(4, "little")
        with open(source, "rb") as src, open(part / f"{name}.dat", "wb") as out:
            out.write(patched)
            src.seek(DAT_HEADER_BYTES + begin * row_bytes)
            left = (end - begin) * row_bytes
            while left:
                buffer = src.read(min(left, 8 << 20))
                if not buffer:
                    raise VerificationFailed(f"{source.name} ended before its row {end}")
                out.write(buffer)
                left -= len(buffer)
        lhs, _, rhs = matrix.text.partition("=")
        shape = _SHAPE.search(rhs)
        if shape is None:
            raise VerificationFailed(f"the declaration of {label} gives no shape")
        dims = ", ".join([str(end - begin), *dims_text(shape.group(1))[1:]])
        rhs = (rhs[: shape.start()] + f"shape = [{dims}]" + rhs[shape.end() :]).replace(
            f"'{label}'", f"'{name}'"
        )
        (part / "graph.nnef").write_text(text.replace(matrix.text, f"{lhs}={rhs}", 1))
        chunks.append({"directory": part.name, "begin": begin, "end": end})
    return chunks, DAT_HEADER_BYTES + min(step, rows) * row_bytes


def dims_text(shape: str) -> list[str]:
    """The dimensions written in a statement's ``shape = [...]``."""
    return [d.strip() for d in shape.split(",") if d.strip()]


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
    block_bytes: int | None = None,
) -> ParityReport:
    """The whole check's decode, block by block: each layer's output against PyTorch's within
    ``atol + rtol * max|layer|`` (as the divergence report judges a layer), and the head's
    logits within the whole check's own tolerance (``atol + rtol * max|logits|``).

    ``block_bytes``: :func:`cut_blocks`' budget. A layer cut below it (attention, MLP, a
    matrix's rows) is judged as a whole one is: its blocks run one after the other, each fed
    the one before it, from PyTorch's input to the layer, and its output is compared with
    PyTorch's; the same numbers as the layer in one block, up to where the boundaries round."""
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
    blocks = cut_blocks(
        graph, unpacked, work / "blocks", int(expected.hidden.shape[-1]), dtype, block_bytes
    )
    request = decode_request(io, expected) | {"hidden": expected.hidden}
    run = run_tract(work / "blocks", "layerwise", request, work / "run", check_abort)
    peaks = [int(p) for p in run.outputs.get("block_peak_rss_bytes", [])]
    figures: list[dict[str, object]] = []
    for index, block in enumerate(blocks):
        figure: dict[str, object] = {"block": block.name, "weight_bytes": block.weight_bytes}
        if block.chunks:
            figure["chunks"] = len(block.chunks)
        if index < len(peaks):
            figure["tract_peak_rss_bytes"] = peaks[index]
        figures.append(figure)
    by_name = {f["block"]: f for f in figures}
    ends = {int(str(o["index"])): b.name for b in blocks for o in b.outputs if o["kind"] == "hidden"}
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
        by_name[ends[layer]] |= {"max_abs_err": diff, "tolerance": tol}
        if not diff <= tol:  # NaN fails too
            parts = [b.name for b in blocks if b.name.split(" ")[:2] == ["layer", str(layer)]]
            ran = "" if parts == [f"layer {layer}"] else f"; it ran as {', '.join(parts)}"
            raise VerificationFailed(
                f"tract's block for {expected.layer_names[layer]} differs from PyTorch by "
                f"{diff:.3g} (tolerance {tol:.3g}), fed PyTorch's input to that layer "
                f"(layer-by-layer check{ran})"
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
