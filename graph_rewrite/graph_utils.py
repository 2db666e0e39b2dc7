"""Small onnx-ir helpers shared by the rules and the layer classification."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

import onnx_ir as ir

ONNX_DOMAINS = frozenset({"", "ai.onnx"})
MS_DOMAIN = "com.microsoft"

# Ops whose first input is the data and whose other inputs are shapes, axes or indices: a walk
# through the graph follows the data only, never a shape computation.
_DATA_IS_FIRST_INPUT = frozenset({
    "Reshape", "Expand", "Slice", "Squeeze", "Unsqueeze", "Tile", "Split", "Pad", "Gather",
    "Transpose", "Cast", "Identity", "Flatten", "Dropout", "ReduceMean", "ReduceSum",
})


def op_name(node: ir.Node) -> str:
    """``Gemm`` for the default domain, ``com.microsoft.FastGelu`` otherwise."""
    return node.op_type if node.domain in ONNX_DOMAINS else f"{node.domain}.{node.op_type}"


def is_onnx_op(node: ir.Node | None, *op_types: str) -> bool:
    return node is not None and node.domain in ONNX_DOMAINS and node.op_type in op_types


def is_op(node: ir.Node | None, names: Iterable[str] | frozenset[str]) -> bool:
    """``names`` holds plain op types for the default domain and ``domain.Op`` for others."""
    return node is not None and op_name(node) in names


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of a value that is a true constant: an initializer that is not also a graph
    input (a graph input can be fed at run time, so its initializer is only a default)."""
    if value is None or not value.is_initializer() or value.is_graph_input():
        return None
    return value.const_value


def is_constant_like(value: ir.Value | None) -> bool:
    """Initializer, graph-input default or Constant node output: not an activation."""
    if value is None:
        return True  # an omitted optional input carries no activation
    if value.is_initializer() or value.const_value is not None:
        return True
    return is_onnx_op(value.producer(), "Constant")


def why_not_constant(value: ir.Value, what: str) -> str:
    """Human reason why ``value`` (a weight or bias) does not count as a constant initializer."""
    label = f"{what} '{value.name}'"
    if value.is_initializer() and value.is_graph_input():
        return f"{label} is an initializer that is also a graph input (it can be overridden at run time)"
    if value.is_graph_input():
        return f"{label} is a graph input, not a constant initializer"
    producer = value.producer()
    if is_onnx_op(producer, "Constant"):
        return (f"{label} comes from a Constant node; lift it to an initializer first "
                "(onnx_ir.passes.common.LiftConstantsToInitializersPass)")
    if producer is not None:
        return f"{label} is computed by {op_name(producer)} node '{producer.name}', not a constant initializer"
    return f"{label} is not a constant initializer"


def dims_of(value: ir.Value | None) -> tuple | None:
    """Static dims (ints, or strings for symbolic dims), or None when the rank is unknown."""
    if value is None:
        return None
    if value.const_value is not None:
        return tuple(int(d) for d in value.const_value.shape)
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else (d.value if d.value is not None else "?")
                 for d in value.shape.dims)


def data_input_indices(node: ir.Node) -> range | tuple[int, ...]:
    """Indices of the inputs that carry activations through ``node`` (not shapes or indices)."""
    if node.domain in ONNX_DOMAINS:
        if node.op_type in _DATA_IS_FIRST_INPUT:
            return (0,)
        if node.op_type == "Where":
            return (1, 2)
    return range(len(node.inputs))


def data_inputs(node: ir.Node) -> Iterator[ir.Value]:
    for index in data_input_indices(node):
        if index < len(node.inputs) and node.inputs[index] is not None:
            yield node.inputs[index]


def data_uses(value: ir.Value) -> Iterator[tuple[ir.Node, int]]:
    """The uses of ``value`` where it flows as data (not as a shape or an index)."""
    for use in value.uses():
        if use.idx in data_input_indices(use.node):
            yield use.node, use.idx


def single_consumer(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) == 1 and not value.is_graph_output():
        return uses[0].node
    return None


def unit_output(linear: ir.Node) -> ir.Value:
    """Output of a linear layer after its own bias ``Add`` (if it has one): the point where the
    layer's result enters the rest of the network."""
    out = linear.outputs[0]
    consumer = single_consumer(out)
    if is_onnx_op(consumer, "Add"):
        other = [v for v in consumer.inputs if v is not out]
        if other and all(is_constant_like(v) for v in other):
            return consumer.outputs[0]
    return out


def walk(
    starts: Iterable[ir.Value],
    step: Callable[[ir.Value], Iterable[ir.Value]],
    max_values: int,
) -> Iterator[ir.Value]:
    """Breadth-first over values, at most ``max_values`` of them (keeps big graphs cheap)."""
    queue = deque(starts)
    seen: set[int] = set()
    while queue and len(seen) < max_values:
        value = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield value
        queue.extend(step(value))


class ValueNames:
    """Hands out value names that no value of the graph uses yet (``wanted``, ``wanted_1``...)."""

    def __init__(self, graph: ir.Graph) -> None:
        self._taken = set(graph.initializers)
        self._taken.update(v.name for v in graph.inputs)
        for node in graph:
            self._taken.update(v.name for v in node.outputs)

    def new(self, wanted: str) -> str:
        name, suffix = wanted, 0
        while name in self._taken:
            suffix += 1
            name = f"{wanted}_{suffix}"
        self._taken.add(name)
        return name
