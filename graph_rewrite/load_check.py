"""Does the op library load every attention node a rewrite wrote? Each PopcountAttention /
PopcountGroupQueryAttention node is opened alone (a one-node model, its inputs as untyped-shape graph
inputs) in an onnxruntime session with the library: the op checks its attributes when the session is
created, so a node it would refuse is found in milliseconds, without loading the model's weights.
The rules are written never to produce such a node (attention_rules/*); this is the self-check that
keeps a rule's slip from becoming a model that does not load (issue 23: softcap=-1 was copied into a
node the op refuses, and rewrite-onnx exited 0)."""
from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import helper

from ..runtime import open_session
from .errors import RewriteError
from .node_models import nodes_alone
from .rules import DOMAIN
from .techniques.popcount import GQA_OP_TYPE, OP_TYPE

CHECKED_OPS = (OP_TYPE, GQA_OP_TYPE)


class UnloadableOutputError(RewriteError):
    """The rewrite produced a node the op library refuses (nothing is written)."""


# The opsets a rewritten attention node may need; a one-node model keeps those its node's domain uses.
_OPSETS = (helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1), helper.make_opsetid("com.microsoft", 1))


def _one_node_model(node: ir.Node) -> onnx.ModelProto:
    """``node`` alone, every input a graph input of unknown shape (no weights: the op checks its
    attributes when the session is created)."""
    types = {value.name: value.dtype.value for value in node.inputs if value is not None and value.dtype is not None}
    return nodes_alone([ir.serde.serialize_node(node)], {}, _OPSETS, ir_version=9, input_types=types,
                       name="load_check")


def refused_nodes(model: ir.Model) -> list[tuple[str, str]]:
    """(node name, the library's message) of every attention node the op library refuses. Only
    refusals by the op itself count (its messages name "<op> node '<name>'")."""
    refused, tried = [], set()
    for node in model.graph:
        if node.domain != DOMAIN or node.op_type not in CHECKED_OPS:
            continue
        key = (node.op_type, tuple(sorted((name, repr(attr.value)) for name, attr in node.attributes.items())),
               tuple(v is not None for v in node.inputs))
        if key in tried:  # same attributes, same inputs wired: the same verdict
            continue
        tried.add(key)
        try:
            open_session(_one_node_model(node))
        except Exception as error:  # noqa: BLE001 - onnxruntime raises its own types
            text = str(error)
            if f"{node.op_type} node '" in text:
                refused.append((node.name or "", text[text.index(f"{node.op_type} node '"):].splitlines()[0]))
    return refused


def check_nodes_load(model: ir.Model) -> None:
    """Raise :class:`UnloadableOutputError` naming the first node the op library refuses."""
    refused = refused_nodes(model)
    if refused:
        name, message = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise UnloadableOutputError(
            f"the rewritten model would not load: {message}{more}; nothing was written. This is a rewriter "
            f"bug (please report it); --attn=off leaves attention as it is")
