"""Graph rewrites that route multi-op patterns of the traced graph to one fused kernel.

Two patterns have no ATen op of their own after decomposition, so the bridge finds them in the
FX graph and replaces their last node with a call of a fused op (SDPA and LayerNorm are single
ATen ops; their lowerings pick the kernel themselves):

- **RMSNorm**, as Hugging Face Llama-style modules write it and torch.export decomposes it:
  `[x.to(f32)] -> pow(2) -> mean(-1, keepdim) -> add(eps) -> rsqrt -> mul(x) -> [.to(dtype)]
  -> mul(weight)`  =>  `rms_norm(x, weight, eps)`.
- **Linear + cross-entropy**: `mm(h, W.T)` / `addmm(b, h, W.T)` -> views, fp32 casts ->
  `_log_softmax(dim=1)` -> `gather(target)` -> `squeeze` -> `neg`, the per-token loss that
  `F.cross_entropy`'s decomposition masks and reduces  =>  `linear_cross_entropy(h, W, b,
  target, reduction="none")`, computed in vocabulary chunks. The masking and reduction nodes
  stay as they are.

When the chunked loss pays: it never holds the [tokens, vocab] logits, their fp32 log-softmax
or their gradient, at the price of recomputing the vocabulary matmul in the backward pass and
of chunked matmuls that run slower per FLOP than one large one (measured on CPU: the loss head
of the GPT-2 bench took 716 ms chunked vs 597 ms unchunked). When the model also returns its
logits (every Hugging Face CausalLM does), the projection must run whole for that output
anyway, and the kernel would repeat it: ~89 instead of 72 GFLOP on the bench step. So the
`"loss"` family fuses only projections whose logits feed the loss alone, and
`"loss_with_returned_logits"` (asked for explicitly) also those the model returns; `families_for`
says which a kernels config enables.

One pattern is rewritten whatever the kernels config, because it is about memory, not a kernel:

- **A matrix broadcast over a bmm's batch**: torch.matmul of an N-d operand by a 2-d one that
  it cannot fold into one mm (the N-d operand is not contiguous, as nn.MultiheadAttention's
  in-projection of its seq-first transpose) decomposes to `expand(W, [B, K, N]) -> view ->
  bmm(x, .)`  =>  `bmm_broadcast_matrix(x, W)`, the same sums as one [B*M, K] x [K, N] dot.
  Eager torch expands with stride 0; `jnp.broadcast_to` makes XLA materialize the B copies and
  the backward a [B, K, N] gradient summed over B. On torchvision ViT-B/16 at 17 tokens that is
  a [17, 768, 2304] fp32 weight (120 MB) per layer, all scheduled at program start, on every
  device: 0.97 GB of the 8-layer forward's temporaries per device, 7.7 GB on 8 simulated CPU
  devices before the backward's copies.

And one so that the backward pass keeps a weight, not a copy of it:

- **A product with a matrix transpose** (nn.Linear's `t(W)`, `permute(W, [1, 0])`):
  `mm(x, t(W))` / `addmm(b, x, t(W))`  =>  `transposed_product(x, W, b)`, the same
  contraction over W's second dim. Lowered as `t` then `mm`, autodiff kept the transpose for
  the input gradient: a copy of every such weight written by each forward that returns its
  residuals (the general path: `forward_vjp`), where the weight itself is already there. Runs
  after the loss fusion, which matches the projection's `mm(h, t(W))` itself.

A node the rewrite removes must be used only inside its pattern (metadata asserts aside), so
nothing the rest of the graph reads disappears. Rewriting works on a copy of the graph: the
exported program stays as torch produced it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from zerojax.bridge.kernel_sharding import per_batch_shard
from zerojax.bridge.lowerings.matmul import add_scaled, is_matrix_transpose, matmul_einsum
from zerojax.bridge.registry import LoweringContext
from zerojax.config import KernelsConfig
from zerojax.pallas_kernels.backend import auto_picks_pallas

aten = torch.ops.aten

_ASSERTS = (aten._assert_tensor_metadata.default,)
# Ops that keep values and element order: logits may pass through them between mm and softmax.
_VALUE_PRESERVING = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.clone.default,
    aten.alias.default,
)


class FusedOp:
    """An FX call target that is its own lowering: `op(ctx, *args)` -> jax value(s)."""

    def __init__(self, name: str, kernel_family: str, lower):
        self.__name__ = self.__qualname__ = name
        self.kernel_family = kernel_family
        self._lower = lower

    def __call__(self, ctx: LoweringContext, *args):
        return self._lower(ctx, *args)

    def __repr__(self) -> str:
        return f"zerojax.{self.__name__}"


def _lower_rms_norm(ctx: LoweringContext, x, weight, eps):
    from zerojax.pallas_kernels.rms_norm import rms_norm

    implementation, interpret = ctx.kernel("norm")
    return per_batch_shard(
        ctx,
        lambda x, weight, axis_index: rms_norm(
            x, weight, eps=eps, implementation=implementation, interpret=interpret
        ),
        (x, weight),
        (True, False),
        family="norm",
    )


def _lower_linear_cross_entropy(ctx: LoweringContext, hidden, weight, bias, target, ignore_index):
    from zerojax.pallas_kernels.linear_cross_entropy import linear_cross_entropy

    implementation, interpret = ctx.kernel("loss")

    def kernel(hidden, weight, bias, target, *, axis_index):
        return linear_cross_entropy(
            hidden,
            weight,
            target,
            bias=bias,
            ignore_index=ignore_index,
            reduction="none",
            implementation=implementation,
            interpret=interpret,
        )

    # Per token: the token rows split over the batch shards like the batch itself.
    return per_batch_shard(
        ctx, kernel, (hidden, weight, bias, target), (True, False, False, True), family="loss"
    )


def _lower_bmm_broadcast_matrix(ctx: LoweringContext, batched, source, side, drop, block, matrix):
    """bmm of `batched` ([B, M, K] for side "right", [B, K, N] for "left") with the matrix that
    `expand` broadcast over the batch: `source` without its `drop` leading size-1 dims,
    broadcast to the expand's per-batch `block` shape (its own, non-batch broadcast) and viewed
    as the [K, N] / [M, K] `matrix`, as the graph's views see each batch's block."""
    one = jnp.broadcast_to(source.reshape(source.shape[drop:]), block).reshape(matrix)
    if side == "right":
        return matmul_einsum("bij,jk->bik", batched, one)
    return matmul_einsum("ij,bjk->bik", one, batched)


def _lower_transposed_product(ctx: LoweringContext, x, matrix, bias, beta, alpha):
    """x @ matrix.T (+ bias, as addmm scales and adds it)."""
    product = matmul_einsum("ij,kj->ik", x, matrix)
    return product if bias is None else add_scaled(bias, product, beta, alpha)


rms_norm_op = FusedOp("rms_norm", "norm", _lower_rms_norm)
linear_cross_entropy_op = FusedOp("linear_cross_entropy", "loss", _lower_linear_cross_entropy)
bmm_broadcast_matrix_op = FusedOp("bmm_broadcast_matrix", "matmul", _lower_bmm_broadcast_matrix)
transposed_product_op = FusedOp("transposed_product", "matmul", _lower_transposed_product)
FUSED_OPS = (rms_norm_op, linear_cross_entropy_op, bmm_broadcast_matrix_op, transposed_product_op)


def families_for(kernels: KernelsConfig) -> frozenset[str]:
    """The pattern families `rewrite` fuses under a kernels config.

    - "norm": unless `kernels.norm` is off.
    - "loss": with `loss: pallas|xla`, or `auto` where auto runs the Pallas kernel (GPU): there
      the chunked loss keeps the logits out of device memory. `auto` on CPU computes the loss
      from whole logits, which is faster there and host memory is not the constraint.
    - "loss_with_returned_logits": only when `loss` is pallas or xla explicitly (see the module
      docstring for why `auto` does not repeat the projection).
    """
    families = set()
    if kernels.norm != "off":
        families.add("norm")
    if kernels.loss in ("pallas", "xla"):
        families |= {"loss", "loss_with_returned_logits"}
    elif kernels.loss == "auto" and auto_picks_pallas(kernels.interpret):
        families.add("loss")
    return frozenset(families)


def rewrite(graph: torch.fx.Graph, families: frozenset[str]) -> torch.fx.Graph:
    """A copy of `graph` with the patterns of the enabled `families` ("norm", "loss",
    "loss_with_returned_logits"; see `families_for`) replaced by fused ops."""
    copy = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    copy.output(copy.graph_copy(graph, env))
    for node in list(copy.nodes):
        if node.op == "call_function" and node.target in _ASSERTS:
            copy.erase_node(node)
    for node in list(copy.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.bmm.default:
            _fuse_bmm_broadcast_matrix(copy, node)
        elif "norm" in families and node.target == aten.mul.Tensor:
            _fuse_rms_norm(copy, node)
        elif "loss" in families and node.target == aten.neg.default:
            _fuse_linear_cross_entropy(
                copy, node, with_returned_logits="loss_with_returned_logits" in families
            )
    copy.eliminate_dead_code()
    for node in list(copy.nodes):
        if _is(node, aten.mm.default, aten.addmm.default):
            _fuse_transposed_product(copy, node)
    copy.eliminate_dead_code()
    return copy


def _is(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _only_used_by(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return set(node.users) == {user}


def _shape(node: torch.fx.Node) -> tuple | None:
    """The recorded shape: ints, and a symbolic capture's sizes as their sympy expressions
    (equal sizes compare equal; `int()` of a SymInt would give the size traced with, not the
    size the graph runs at: symbolic_shapes.py)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(
        int(d) if isinstance(d, int) or d.node.is_constant() else d.node.expr for d in val.shape
    )


def _static_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The recorded shape when every dim is an int, else None."""
    shape = _shape(node)
    return shape if shape is not None and all(isinstance(d, int) for d in shape) else None


def _replace(graph: torch.fx.Graph, last: torch.fx.Node, op: FusedOp, args: tuple) -> None:
    with graph.inserting_before(last):
        fused = graph.call_function(op, args)
    fused.meta = dict(last.meta)
    last.replace_all_uses_with(fused)
    graph.erase_node(last)


def _fuse_bmm_broadcast_matrix(graph: torch.fx.Graph, bmm: torch.fx.Node) -> None:
    """bmm(x, views of expand(W)) where the expand broadcasts the leading dims that the views
    merge into the batch dim: every batch's block is one and the same matrix (module docstring).
    The expand and views stay for any other user; dead code elimination drops them otherwise."""
    for side, position in (("right", 1), ("left", 0)):
        operand = bmm.args[position]
        while _is(operand, *_VALUE_PRESERVING):
            operand = operand.args[0]  # views reshape row-major: their chain is one reshape
        if not _is(operand, aten.expand.default):
            continue
        # Static shapes only: the fused op takes sizes as arguments, fixed in the graph.
        source, expanded = operand.args[0], _static_shape(operand)
        viewed, source_shape = _static_shape(bmm.args[position]), _static_shape(source)
        if source_shape is None or expanded is None or viewed is None:
            continue
        new_dims = len(expanded) - len(source_shape)
        broadcast = 0  # leading dims of the expand's output that are broadcast
        while broadcast < len(expanded) and (
            broadcast < new_dims or source_shape[broadcast - new_dims] == 1
        ):
            broadcast += 1
        # The bmm's batch dim must be exactly some of those broadcast dims, merged.
        merged = next(
            (m for m in range(1, broadcast + 1) if math.prod(expanded[:m]) == viewed[0]), None
        )
        if merged is None:
            continue
        args = (bmm.args[1 - position], source, side, broadcast - new_dims)
        _replace(graph, bmm, bmm_broadcast_matrix_op, (*args, expanded[merged:], viewed[1:]))
        return


def _fuse_transposed_product(graph: torch.fx.Graph, product: torch.fx.Node) -> None:
    """mm(x, t(W)) / addmm(b, x, t(W)) with the transpose used by this product alone."""
    if product.target == aten.mm.default:
        (x, transposed), bias = product.args, None
    else:
        bias, x, transposed = product.args
    beta, alpha = product.kwargs.get("beta", 1), product.kwargs.get("alpha", 1)
    if not is_matrix_transpose(transposed) or not _only_used_by(transposed, product):
        return
    _replace(graph, product, transposed_product_op, (x, transposed.args[0], bias, beta, alpha))


def _fuse_rms_norm(graph: torch.fx.Graph, final: torch.fx.Node) -> None:
    for weight, normed in (final.args, final.args[::-1]):
        cast = None
        if _is(normed, aten._to_copy.default):
            cast, normed = normed, normed.args[0]
        if not _is(normed, aten.mul.Tensor):
            continue
        a, b = normed.args
        x, rsqrt = (a, b) if _is(b, aten.rsqrt.default) else (b, a)
        if not _is(rsqrt, aten.rsqrt.default):
            continue
        add = rsqrt.args[0]
        if not (_is(add, aten.add.Tensor) and isinstance(add.args[1], float)):
            continue
        mean = add.args[0]
        if not _is(mean, aten.mean.dim) or not _is(mean.args[0], aten.pow.Tensor_Scalar):
            continue
        power = mean.args[0]
        x_shape, weight_shape = _shape(x), _shape(weight)
        if (
            power.args[0] is not x
            or power.args[1] != 2
            or x_shape is None
            or list(mean.args[1]) not in ([-1], [len(x_shape) - 1])
            or not (len(mean.args) > 2 and mean.args[2])
            or weight_shape != x_shape[-1:]
        ):
            continue
        chain = [power, mean, add, rsqrt, normed] + ([cast] if cast is not None else [])
        users = [mean, add, rsqrt, normed] + ([cast] if cast is not None else []) + [final]
        if not all(_only_used_by(n, u) for n, u in zip(chain, users, strict=True)):
            continue
        source = x
        if _is(x, aten._to_copy.default) and set(x.users) == {power, normed}:
            source = x.args[0]  # the fp32 upcast happens inside the kernel
        _replace(graph, final, rms_norm_op, (source, weight, add.args[1]))
        return


def _fuse_linear_cross_entropy(
    graph: torch.fx.Graph, neg: torch.fx.Node, *, with_returned_logits: bool
) -> None:
    squeeze = neg.args[0]
    if not (_is(squeeze, aten.squeeze.dims, aten.squeeze.dim) and _only_used_by(squeeze, neg)):
        return
    gather = squeeze.args[0]
    if not (_is(gather, aten.gather.default) and gather.args[1] == 1):
        return
    log_softmax = gather.args[0]
    if not (
        _is(log_softmax, aten._log_softmax.default)
        and log_softmax.args[1] in (1, -1)
        and _only_used_by(log_softmax, gather)
        and _only_used_by(gather, squeeze)
    ):
        return
    target, ignore_index = _target_of(gather.args[2])
    if target is None:
        return
    logits = log_softmax.args[0]
    tokens_vocab = _shape(logits)
    if tokens_vocab is None or len(tokens_vocab) != 2:
        return
    logits_used_elsewhere = False
    while _is(logits, *_VALUE_PRESERVING) or _is_float32_cast(logits):
        logits_used_elsewhere |= len(logits.users) > 1
        logits = logits.args[0]
    logits_used_elsewhere |= len(logits.users) > 1
    if logits_used_elsewhere and not with_returned_logits:
        return
    if _is(logits, aten.mm.default):
        hidden, transposed = logits.args
        bias = None
    elif _is(logits, aten.addmm.default) and logits.args[3:] == () and not logits.kwargs:
        bias, hidden, transposed = logits.args
        if _shape(bias) != tokens_vocab[1:]:
            return
    else:
        return
    if not is_matrix_transpose(transposed) or _shape(logits) != tokens_vocab:
        return
    weight, hidden_shape = transposed.args[0], _shape(hidden)
    if hidden_shape is None or _shape(weight) != (tokens_vocab[1], hidden_shape[1]):
        return
    _replace(graph, neg, linear_cross_entropy_op, (hidden, weight, bias, target, ignore_index))


def _is_float32_cast(node) -> bool:
    """`logits.float()` (Hugging Face upcasts before the loss): the fused op is fp32 anyway."""
    return (
        _is(node, aten._to_copy.default)
        and set(node.kwargs) == {"dtype"}
        and node.kwargs["dtype"] == torch.float32
    )


def _target_of(index: torch.fx.Node) -> tuple[torch.fx.Node | None, int]:
    """`unsqueeze(where(ne(t, ignore), t, 0), 1)` -> (t, ignore); (None, 0) if not that shape.

    F.cross_entropy's decomposition replaces ignored targets by 0 before the gather; the fused
    op takes the raw targets and the ignore_index instead (ignored tokens give 0 loss).
    """
    if not (_is(index, aten.unsqueeze.default) and index.args[1] in (1, -1)):
        return None, 0
    where = index.args[0]
    if not _is(where, aten.where.self, aten.where.ScalarOther):
        return None, 0
    condition, target = where.args[0], where.args[1]
    if _is(condition, aten.ne.Scalar) and condition.args[0] is target:
        return target, int(condition.args[1])
    return None, 0
