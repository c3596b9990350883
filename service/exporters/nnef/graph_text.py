"""Text surgery on torch-to-nnef's ``graph.nnef``: which variable is each layer's output, that
variable made a graph output, and the head copied over every position.

Both sides import it: the job process (:mod:`service.exporters.nnef.layerwise` cuts the archive
at :func:`layer_outputs`) and the tract child (:mod:`service.exporters.nnef.tract_cli`, which
edits the graph it loads). The child runs by path without the ``service`` package, and imports
this module from its own directory: it imports nothing but the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_GRAPH_HEADER = re.compile(r"^graph (\w+)\((.*?)\) -> \((.*?)\)$", re.MULTILINE)


# --- layer outputs, to say where a mismatch starts ----------------------------------------------

_STATEMENT = re.compile(r"^\s+(\w+) = (\w+)\(([^,)]*)", re.MULTILINE)
_LAYER_VAR = re.compile(r"^(\w*?[A-Za-z0-9])_{2,3}(\d+)_")


def layer_outputs(graph: str) -> list[str]:
    """The variable holding each layer's output in a torch-to-nnef ``graph.nnef``, in order.

    torch-to-nnef names a value after the module that computed it with the layer index set
    apart by underscores (``model_model__2_hiddenStatesAdd2`` in ``model.model.layers.2``,
    ``model__encoder___2__output__...`` in ``encoder.layer.2``). A layer's output is the last
    value its layer computes (the residual add, or a post-norm), unless the graph's own output
    is computed straight from it (BERT's last layer norm is named ``last_hidden_state``).
    """
    header = _GRAPH_HEADER.search(graph)
    if header is None:
        return []
    graph_outputs = {o.strip() for o in header.group(3).split(",")}
    statements = _STATEMENT.findall(graph[header.end() :])
    shapes: set[str] = set()  # values computed from a shape (tract_core_shape_of), not data
    stacks: dict[str, dict[int, str]] = {}
    for name, op, first in statements:
        if op == "tract_core_shape_of" or first.strip() in shapes:
            shapes.add(name)
            continue
        match = _LAYER_VAR.match(name)
        if match:
            stacks.setdefault(match.group(1), {})[int(match.group(2))] = name  # the last wins
    if not stacks:
        return []
    layers = max(stacks.values(), key=len)
    if sorted(layers) != list(range(len(layers))):
        return []
    names = [layers[i] for i in range(len(layers))]
    for name, _op, first in statements:
        if name in graph_outputs and first.strip() == names[-1]:
            names[-1] = name
    return names


def expose_layer_outputs(graph: str, names: Sequence[str]) -> str:
    """``graph`` with ``names`` appended to the graph's outputs (tract then computes them)."""
    header = _GRAPH_HEADER.search(graph)
    if header is None:
        raise ValueError("no graph declaration in graph.nnef")
    outputs = [o.strip() for o in header.group(3).split(",")]
    added = [n for n in names if n not in outputs]
    line = f"graph {header.group(1)}({header.group(2)}) -> ({', '.join(outputs + added)})"
    return graph[: header.start()] + line + graph[header.end() :]


# --- the head over every position, for the fixed text's window at once --------------------------

_LAST_POSITION = re.compile(
    r"^\s+(\w+) = dyn_slice_begin\((\w+), axis = 1, begin = -1, stride = 1\);$", re.MULTILINE
)
_ASSIGNMENT = re.compile(r"^(\s+)(\w+) = (.*);$", re.MULTILINE)
ALL_POSITIONS_SUFFIX = "__every_position"


def head_over_every_position(graph: str) -> str | None:
    """``graph`` with one more, trailing output: the logits of every position.

    torch-to-nnef's LLM graph computes the head on the last position only (a
    ``dyn_slice_begin(x, axis = 1, begin = -1)`` of the final norm's output, then the head's
    statements). The added output is those same head statements, copied verbatim with the slice
    replaced by its input, so a prompt's one run gives the logits of each of its positions: the
    block-by-block fixed-text check (``tract_cli.run_layerwise_chunks``) then runs each block twice a
    chunk instead of once per scored position. The shipped outputs are untouched. None when the
    graph has no such slice (the caller then runs one position a step).

    Not used on the whole archive: there it would need the archive unpacked to edit its graph
    (tract loads a ``.tgz`` as it is), which on a quiet host cost what the runs saved (1.76 GB
    float32: unpack + load 10.1 s against a load of 5.7 s, the text's runs 6.8 s against 13.5 s)
    and raised tract's peak by 0.15-0.2 GiB, past its plan (``bench/export_nnef.py``)."""
    header = _GRAPH_HEADER.search(graph)
    slices = list(_LAST_POSITION.finditer(graph))
    if header is None or len(slices) != 1:
        return None
    (sliced,) = slices
    outputs = [o.strip() for o in header.group(3).split(",")]
    renamed = {sliced.group(1): sliced.group(2)}  # the slice's consumers read its input instead
    copies = []
    for match in _ASSIGNMENT.finditer(graph, sliced.end()):
        indent, name, expression = match.groups()
        used = set(re.findall(r"\b\w+\b", expression)) & renamed.keys()
        if not used:
            continue
        for old in used:
            expression = re.sub(rf"\b{old}\b", renamed[old], expression)
        renamed[name] = name + ALL_POSITIONS_SUFFIX
        copies.append(f"{indent}{renamed[name]} = {expression};")
    added = renamed.get(outputs[0])
    if added is None or added == sliced.group(2):
        return None
    end = graph.rindex("}")
    body = graph[:end].rstrip("\n") + "\n" + "\n".join(copies) + "\n" + graph[end:]
    line = f"graph {header.group(1)}({header.group(2)}) -> ({', '.join([*outputs, added])})"
    return body[: header.start()] + line + body[header.end() :]
