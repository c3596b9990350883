"""A decoder's ONNX graph at any depth from a capture of two layers: capture time flat in depth.

torch's dynamo exporter traces every decoder layer in Python, and the ONNX translation then
walks every node: 3 -> 18 layers took 5.9 -> 19.1 s, although the layers are one graph with
different weights. Here the model is captured with its first two layers only, and the second
layer's nodes are stamped once for each further layer (:func:`stamp_layers`): its weights
renamed to that layer's (``model.layers.K.*``, read from that layer's store entry like any
other initializer), its ``past_key_values.1.*`` inputs and ``present.1.*`` outputs renamed to
that layer's, its carried inputs (the residual stream, anything else the first layer hands the
second) taken from the previous stamp, and every value shared by all layers (the rotary cos/sin,
the attention mask, position ids) used as it is. The final norm and head then read the last
stamp. The result is the graph a full capture gives, layer for layer.

Why the second layer and not the first: the first reads the embedding's output, the second
reads what a layer hands on, which is what each further layer reads. Why two captured layers
and not one: the two are compared node by node before anything is stamped, and stamping goes
ahead only when the second is the first with its weights, cache and carried values renamed
(same operators and attributes in the same order, the same shared inputs). A graph that
depends on the layer's index beyond that (a per-layer attention window, a layer without rope)
fails the comparison and is captured whole (:class:`NotStampable`), as are configurations
whose ``layer_types`` mix kinds of layers, which two layers cannot represent.

Why not dynamo's own mechanism for repeated blocks (``torch.compiler.nested_compile_region``,
exported as ``invoke_subgraph``, written as ONNX local functions): it needs the strict (dynamo)
trace, and a layer updating transformers' ``DynamicCache`` (a Python list mutated in place) is a
side effect such a region cannot hold; and its result is a graph of functions that onnxruntime
inlines when it loads the model, a cost moved to every consumer, in a layout unlike optimum's
flat graph. Stamping keeps the flat graph and its names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

CAPTURED_LAYERS = 2
"""Layers captured by dynamo when the others are stamped."""

_SCOPES = "pkg.torch.onnx.name_scopes"


class NotStampable(Exception):
    """The captured layers are not one graph with renamed weights: capture the model whole."""


@dataclass(frozen=True)
class LayerNames:
    """How layer ``k``'s module path, weights, cache inputs and outputs are spelled."""

    module: str
    """Module path of the layer list in the captured graph's scopes, e.g. ``model.model.layers``."""
    weights: str
    """Prefix of the layer list's weights among the initializers, e.g. ``model.layers``."""

    def scope(self, k: int) -> str:
        return f"{self.module}.{k}"

    def weight(self, name: str, source: int, target: int) -> str | None:
        """``name`` (a weight of layer ``source``) as layer ``target``'s; None if not one."""
        prefix = f"{self.weights}.{source}."
        return f"{self.weights}.{target}.{name[len(prefix) :]}" if name.startswith(prefix) else None


def _layer_of(node: ir.Node, names: LayerNames, pattern: re.Pattern[str]) -> int | None:
    scopes = node.metadata_props.get(_SCOPES)
    if scopes is None:
        raise NotStampable(f"node {node.name} has no {_SCOPES} metadata")
    match = pattern.search(scopes)
    return int(match.group(1)) if match else None


def _split(graph: ir.Graph, names: LayerNames) -> tuple[list[ir.Node], list[ir.Node]]:
    """The nodes of layer 0 and layer 1 (and those made of its cache inputs alone before it), in
    graph order, ``Constant`` nodes left out: the
    exporter makes a constant once and every later layer reads it (a norm's epsilon), so
    constants are compared by value where they are read (:func:`_constant`), not as nodes."""
    # dynamo spells a layer reached through a slice of the list ``layers.slice(None, 2, None).0``
    pattern = re.compile(rf"'{re.escape(names.module)}(?:\.slice\([^)]*\))?\.(\d+)'")
    layers: dict[int, set[ir.Node]] = {0: set(), 1: set()}
    # What is made of one layer's cache inputs alone, outside the layers.
    derived: dict[ir.Value, int] = {
        v: int(v.name.split(".")[1])
        for v in graph.inputs if v.name and v.name.startswith("past_key_values.")
    }  # fmt: skip
    order: dict[ir.Node, int] = {}
    for node in graph:
        order[node] = len(order)
        if _is_constant(node):
            continue
        k = _layer_of(node, names, pattern)
        if k is not None:
            if k not in layers:
                raise NotStampable(f"a node of layer {k} in a capture of {CAPTURED_LAYERS}")
            layers[k].add(node)
            continue
        sources = {
            derived.get(v, -1) for v in node.inputs if v is not None and _constant(v) is None
        }
        if len(sources) == 1 and -1 not in sources:
            derived.update(dict.fromkeys(node.outputs, sources.pop()))
    # A layer's own prologue: those of them only the layer reads (the wrapper's
    # DynamicCache.update appends each cache input to an empty cache before the layer runs). A
    # size read off one layer's cache and used by all (torch.export's batch size) is shared.
    for k, nodes in layers.items():
        stack = list(nodes)
        while stack:
            for v in stack.pop().inputs:
                producer = None if v is None else v.producer()
                if (
                    v is not None and producer is not None and producer not in nodes
                    and derived.get(v) == k
                    and all(use.node in nodes for out in producer.outputs for use in out.uses())
                ):  # fmt: skip
                    nodes.add(producer)
                    stack.append(producer)
    first, second = (sorted(layers[k], key=order.__getitem__) for k in (0, 1))
    if not first or len(first) != len(second):
        raise NotStampable(f"layers of {len(first)} and {len(second)} nodes")
    return first, second


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and not node.inputs


def _constant(value: ir.Value) -> tuple[Any, ...] | None:
    """What the output of a ``Constant`` node holds (dtype, shape, bytes, or its attribute);
    None for any other value. Initializers are the module's tensors, compared by name (on
    meta they have no bytes)."""
    import onnx_ir as ir

    producer = value.producer()
    if producer is not None and _is_constant(producer):
        (attr,) = producer.attributes.values()
        if attr.type == ir.AttributeType.TENSOR:
            tensor = attr.as_tensor()
            return (tensor.dtype, tuple(tensor.shape), tensor.tobytes())
        return (attr.name, attr.type, repr(attr.value))
    return None


def _same_attributes(a: ir.Node, b: ir.Node) -> bool:
    import onnx_ir as ir

    if a.attributes.keys() != b.attributes.keys():
        return False
    for key, attr in a.attributes.items():
        other = b.attributes[key]
        if attr.type != other.type or attr.is_ref() or other.is_ref():
            return False
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return False
        if attr.type == ir.AttributeType.TENSOR:
            x, y = attr.as_tensor(), other.as_tensor()
            if (x.dtype, x.shape, x.tobytes()) != (y.dtype, y.shape, y.tobytes()):
                return False
        elif attr.value != other.value:
            return False
    return True


@dataclass
class _Template:
    """Layer 1 as a template: for each of its external inputs, how a stamp gets it."""

    nodes: list[ir.Node]
    carried: dict[ir.Value, ir.Value]
    """Layer 1's input -> the value of layer 1 that a stamp's predecessor hands on in its place."""
    weights: dict[ir.Value, str]
    """Layer 1's weight -> its name (``model.layers.1.*``)."""
    cache_inputs: dict[ir.Value, int]
    """Layer 1's ``past_key_values.1.*`` input -> its position among the graph's inputs."""


def _template(graph: ir.Graph, names: LayerNames) -> _Template:
    """Match layer 0 against layer 1 node by node; :class:`NotStampable` at the first mismatch."""
    first, second = _split(graph, names)
    inside0 = {out: (i, j) for i, n in enumerate(first) for j, out in enumerate(n.outputs)}
    inside1 = {out: (i, j) for i, n in enumerate(second) for j, out in enumerate(n.outputs)}
    inputs = list(graph.inputs)
    carried: dict[ir.Value, ir.Value] = {}
    weights: dict[ir.Value, str] = {}
    cache: dict[ir.Value, int] = {}
    for a, b in zip(first, second, strict=True):
        if (a.domain, a.op_type, a.overload, len(a.inputs), len(a.outputs)) != (
            b.domain, b.op_type, b.overload, len(b.inputs), len(b.outputs)
        ) or not _same_attributes(a, b):  # fmt: skip
            raise NotStampable(f"{a.op_type} of layer 0 is {b.op_type} in layer 1")
        for x, y in zip(a.inputs, b.inputs, strict=True):
            if x is None or y is None:
                if x is not y:
                    raise NotStampable(f"an optional input of {a.op_type} differs")
                continue
            cx, cy = _constant(x), _constant(y)
            if cx is not None or cy is not None:  # stamps read layer 1's constant
                if cx != cy:
                    raise NotStampable(f"{a.op_type} reads constants that differ")
            elif x in inside0 or y in inside1:  # both internal, at the same place
                if inside0.get(x) != inside1.get(y):
                    raise NotStampable(f"{a.op_type}'s input differs between the layers")
            elif y in inside0:  # layer 1 reads what layer 0 made: carried
                i, j = inside0[y]
                carried[y] = second[i].outputs[j]
            elif x is y:  # shared: computed before the layers, a graph input
                continue
            elif x.is_initializer() and y.is_initializer() and y.name:
                if names.weight(y.name, 1, 0) != x.name:
                    raise NotStampable(f"weights {x.name} and {y.name} do not correspond")
                weights[y] = y.name
            elif x in inputs and y in inputs:
                if (x.name or "").replace(".0.", ".1.", 1) != y.name:
                    raise NotStampable(f"graph inputs {x.name} and {y.name} do not correspond")
                cache[y] = inputs.index(y)
            else:
                raise NotStampable(f"{a.op_type} reads {x.name} in layer 0, {y.name} in layer 1")
    return _Template(second, carried, weights, cache)


def _renamed(name: str | None, k: int) -> str | None:
    return None if name is None else f"layers.{k}/{name}"


def _input_name(name: str, k: int) -> str:
    """``past_key_values.1.key`` as layer ``k``'s; ``present.1.value`` likewise."""
    head, index, tail = name.split(".", 2)
    if index != "1":
        raise NotStampable(f"{name} is not layer 1's")
    return f"{head}.{k}.{tail}"


def stamp_layers(model: ir.Model, names: LayerNames, layers: int) -> None:
    """Turn ``model``, captured with :data:`CAPTURED_LAYERS` layers, into one of ``layers``.

    Raises :class:`NotStampable`, leaving ``model`` untouched, when layer 1 is not layer 0
    renamed; the caller then captures the model whole."""
    import onnx_ir as ir

    graph = model.graph
    template = _template(graph, names)
    in_template = set(template.nodes)
    present = {
        v: i for i, v in enumerate(graph.outputs) if v.name and v.name.startswith("present.1.")
    }
    if len(present) != len(template.cache_inputs) or any(
        v.producer() not in in_template for v in present
    ):
        raise NotStampable("layer 1's cache outputs do not match its inputs")
    # Where layer 1's values are read after it (the final norm, the graph outputs).
    consumers: list[tuple[ir.Node, int, ir.Value]] = []
    for node in graph:
        if node not in in_template:
            consumers += [(node, i, v) for i, v in enumerate(node.inputs)
                          if v is not None and v.producer() in in_template]  # fmt: skip
    if any(v in present for _, _, v in consumers):
        raise NotStampable("a cache output of layer 1 is read by another node")

    previous: dict[ir.Value, ir.Value] = {}  # layer 1's values -> the last stamp's
    new_inputs: list[ir.Value] = []
    new_outputs: list[ir.Value] = []
    stamped: list[ir.Node] = []
    for k in range(CAPTURED_LAYERS, layers):
        mapping: dict[ir.Value, ir.Value] = {}
        for value, produced in template.carried.items():
            mapping[value] = previous.get(produced, produced)
        for value, name in template.weights.items():
            weight = ir.Value(name=names.weight(name, 1, k), type=value.type,
                              shape=value.shape.copy() if value.shape is not None else None)  # fmt: skip
            weight.const_value = _unread(weight)
            graph.register_initializer(weight)
            mapping[value] = weight
        for value in sorted(template.cache_inputs, key=template.cache_inputs.__getitem__):
            past = ir.Value(name=_input_name(value.name or "", k), type=value.type,
                            shape=value.shape.copy() if value.shape is not None else None)  # fmt: skip
            new_inputs.append(past)
            mapping[value] = past
        for node in template.nodes:
            inputs = [None if v is None else mapping.get(v, v) for v in node.inputs]
            clone = ir.Node(
                node.domain, node.op_type, inputs, list(node.attributes.values()),
                overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                name=_renamed(node.name, k),
                metadata_props={
                    key: value.replace(f"{names.scope(1)}", f"{names.scope(k)}")
                    for key, value in node.metadata_props.items() if key in ("namespace", _SCOPES)
                },
            )  # fmt: skip
            for old, new in zip(node.outputs, clone.outputs, strict=True):
                new.name = _renamed(old.name, k)
                new.type = old.type
                new.shape = old.shape.copy() if old.shape is not None else None
                mapping[old] = new
            stamped.append(clone)
        for value in sorted(present, key=present.__getitem__):
            out = mapping[value]
            out.name = _input_name(value.name or "", k)
            new_outputs.append(out)
        previous = mapping
    if not stamped:
        return
    graph.insert_after(template.nodes[-1], stamped)
    for node, i, value in consumers:
        node.replace_input_with(i, previous[value])
    for i, value in enumerate(graph.outputs):
        if value.producer() in in_template and value not in present:
            graph.outputs[i] = previous[value]
    graph.inputs.extend(new_inputs)
    graph.outputs.extend(new_outputs)
    graph.sort()


def _unread(weight: ir.Value) -> ir.LazyTensor:
    """A stamped weight's placeholder, as the traced ones hold meta tensors until the export
    gives each initializer its data; reading it is an error."""
    import onnx_ir as ir

    name = weight.name

    def unread() -> ir.Tensor[Any]:
        raise RuntimeError(f"the stamped weight {name} was never given its data")

    assert weight.dtype is not None and weight.shape is not None
    return ir.LazyTensor(unread, dtype=weight.dtype, shape=weight.shape, name=name)


def layer_names(module: Any, wrapped: str) -> LayerNames:
    """Where ``module`` (a transformers causal LM, wrapped under the attribute ``wrapped``)
    keeps its decoder layers; :class:`NotStampable` when it is not a ModuleList of
    ``num_hidden_layers`` layers."""
    from torch import nn

    count = int(module.config.num_hidden_layers)
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name.endswith("layers") and len(child) == count:
            return LayerNames(module=f"{wrapped}.{name}", weights=name)
    raise NotStampable("no list of decoder layers")
