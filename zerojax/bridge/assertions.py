"""Runtime assertions in an exported graph, and the values computed only to feed them.

torch.export turns `torch._check(...)`, shape guards on data-dependent sizes and input metadata
checks into assertion nodes (`_assert_scalar`, `_assert_async`, `_assert_tensor_metadata`, ...).
A jitted XLA program cannot raise, so zerojax does not enforce them; and the chain that computes
an assertion's condition can hold ops that mean nothing outside eager torch. Hugging Face LLaVA's
`get_placeholder_mask` checks `(input_ids == image_token).all()` through
`_is_all_true -> item() -> sym_ite -> _assert_scalar`: a host read of a traced value, which a
compiled program cannot do, feeding nothing but the assertion.

`drop_assertions` removes the assertion nodes and every node whose values reach nothing else,
before the interpreter sees the graph. A value an assertion shares with real computation stays.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

ASSERTIONS = frozenset(
    {
        aten._assert_scalar.default,
        aten._assert_async.default,
        aten._assert_async.msg,
        aten._assert_tensor_metadata.default,
        aten._functional_assert_async.msg,
        aten._functional_assert_scalar.default,
        aten.sym_constrain_range.default,
        aten.sym_constrain_range_for_size.default,
        aten._functional_sym_constrain_range.default,
        aten._functional_sym_constrain_range_for_size.default,
    }
)


def drop_assertions(graph: torch.fx.Graph) -> int:
    """Erase assertion nodes and the nodes that only feed them; returns how many were erased.

    Placeholders and the output node always stay (the graph signature names them), as does any
    node with a user outside the dropped set.
    """
    dead: set[torch.fx.Node] = set()
    # Reverse topological order: a node's users are decided before the node itself.
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ASSERTIONS or (node.users and all(user in dead for user in node.users)):
            dead.add(node)
    for node in reversed(graph.nodes):
        if node in dead:
            graph.erase_node(node)
    return len(dead)
