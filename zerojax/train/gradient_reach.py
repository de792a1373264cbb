"""Which gradients a loss reaches, read statically off a traced program: torch's `None`.

torch gives a parameter `.grad = None` when no path of differentiable ops leads from it to the
loss, and every optimizer then skips it (no weight decay, no moment update). JAX's autodiff
knows the same thing (symbolic zeros), but a program's outputs are arrays: `jax.vjp` and
`jax.grad` hand back zeros for such a parameter, indistinguishable by value from a gradient
that happens to be zero (which torch steps with).

The gradient programs (`zerojax.train.programs`: `backward`, `loss_and_grads`) multiply every
cotangent the loss sends (or the loss itself) by the loss scale `scale`, one of their inputs
(1.0 without fp16 loss scaling). A gradient is linear in those cotangents, so a gradient the
loss reaches is computed from `scale`, and one it does not reach is a constant zero, computed
from nothing that depends on it. `reached_outputs` walks the program's jaxpr once, when the
program is compiled for a signature, marking every value computed from a given input; the
gradients not marked are the `None`s. Nothing runs and no value is read: the answer is part
of the compiled program, and costs no host sync per step.

The walk is exact through the primitives that call a jaxpr as a function (`jit`, `remat`,
custom derivatives, `shard_map`: each output depends on what its own body computes it from),
and treats any other primitive with a marked input as marking all of its outputs (loops,
conditionals). Erring that way only keeps a zero gradient, as zerojax did before.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.extend import core as jax_core

__all__ = ["reached_outputs"]

# Primitives whose jaxpr parameter is called once on the equation's operands, returning its
# results: the body's own dependencies hold (unlike a loop, whose carry feeds back).
_CALLS = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
        "shard_map",
        "compute_on",
        "compute_on2",
    }
)


def reached_outputs(closed_jaxpr, marked_inputs: Sequence[bool]) -> list[bool]:
    """For each output of `closed_jaxpr`, whether it is computed from an input marked in
    `marked_inputs` (one flag per `jaxpr.invars` entry)."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    if len(marked_inputs) != len(jaxpr.invars):
        raise ValueError(
            f"marked_inputs has {len(marked_inputs)} flags, the jaxpr {len(jaxpr.invars)} inputs"
        )
    return _walk(jaxpr, list(marked_inputs))


def _walk(jaxpr, marked_inputs: list[bool]) -> list[bool]:
    marked: dict = {v: m for v, m in zip(jaxpr.invars, marked_inputs, strict=True) if m}

    def is_marked(atom) -> bool:
        # Literals and the jaxpr's constants depend on no input.
        return not isinstance(atom, jax_core.Literal) and atom in marked

    for eqn in jaxpr.eqns:
        inputs = [is_marked(a) for a in eqn.invars]
        if not any(inputs):
            continue
        for var, m in zip(eqn.outvars, _equation(eqn, inputs), strict=True):
            if m:
                marked[var] = True
    return [is_marked(v) for v in jaxpr.outvars]


def _equation(eqn, inputs: list[bool]) -> list[bool]:
    name = eqn.primitive.name
    if name == "optimization_barrier":  # the identity on each operand, scheduled together
        return inputs
    if name in _CALLS:
        bodies = [
            p for p in eqn.params.values() if isinstance(p, jax_core.ClosedJaxpr | jax_core.Jaxpr)
        ]
        if len(bodies) == 1:
            body = getattr(bodies[0], "jaxpr", bodies[0])
            if len(body.invars) == len(inputs) and len(body.outvars) == len(eqn.outvars):
                return _walk(body, inputs)
    return [True] * len(eqn.outvars)


def flat_argument_marks(args: tuple, argnum: int) -> list[bool]:
    """One flag per flattened leaf of `args` (a jitted function's positional arguments, in
    `jax.jit`'s flattening order): True for the leaves of `args[argnum]`."""
    return [i == argnum for i, arg in enumerate(args) for _ in range(len(jax.tree.leaves(arg)))]
