"""Out-of-range indices: flagged inside the compiled program, raised on the host as torch raises.

torch checks every index an op reads (`nn.Embedding` with token 200 of 128 rows, a gather, a
scatter, `cross_entropy` with target 99 of 8 classes, `one_hot`) and raises at the op: an
`IndexError` or `RuntimeError` on CPU, a device-side assert on GPU. JAX cannot raise inside a
compiled program; its gathers clamp and its scatters drop, so the lowerings (which keep doing
so) would turn a tokenizer/vocabulary mismatch into training on garbage without a word.

So the check is data, like the fp16 overflow flag:

- `sites_of(node, args)` is the static table: which argument of an op is an index, the size of
  the dim it indexes, whether negative indices wrap (torch op by op: `x[i]` and `take` allow
  -n..n-1; embedding, gather, index_select, scatter and index_add do not), and torch's error
  (type and message). Ops that torch.export decomposes are recognised by the op the user called
  (`original_aten`, else `torch_fn`): `cross_entropy`/`nll_loss` are a gather of the targets
  (ignored targets replaced by 0 first, so `ignore_index` is never flagged), `index_add` /
  `index_copy` / `index_fill` an `index_put`, `take` an index of the flat view, `one_hot` an
  `eq` against an arange.
- `IndexBounds` records, while the interpreter traces the graph, the min and max of each
  checked index array (two reductions XLA fuses into one pass over the indices; under sharding
  a reduction per shard and a scalar all-reduce). `packed()` is one int32 vector
  `[table id, lo0, hi0, lo1, hi1, ...]`, an extra output of the program. The static part of
  every site (op, module path, bound, error) is kept in a process-wide table under that id, so
  the host decodes a vector from any program, any trace, without a side channel.
- `raise_if_out_of_range(vector)` reads the vector (a transfer of a few ints) and raises
  torch's error for the first site out of range, naming the op, the nn.Module path and source
  line (`nn_module_stack`), the offending value and the allowed range.

When the error is raised: torch raises at the op; zerojax raises at the first host read of
that step's results -- when `model(x)` hands its outputs to torch, which waits for the program
anyway -- or, where those outputs were not waited for, at the latest at the next call into the
engine (`loss.backward()`, `optimizer.step()`, the next forward), which then waits for the flag.
The optimizer never applies gradients of a step whose indices were out of range. The step's
values up to the raise are garbage, as they are after torch's device-side assert.
Ops on live tensors (`zerojax.bridge.eager`) check immediately: such a call waits for its flag.

An index known at trace time (a constant of the graph) is checked then, and an index computed
by an `arange` that provably fits (GPT-2's position ids) is not checked at all. On the GPT-2
bench step the check measured within noise of 1% (BENCHMARKS.md, `bench/index_check.py`);
`train.check_index_bounds: false` turns it off.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

from zerojax.bridge.errors import node_location

aten = torch.ops.aten

# The user-level ops whose decompositions end in an op checked here, by their schema name.
_NLL_LOSS = frozenset({"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd"})
_NLL_FUNCTIONS = frozenset({"cross_entropy", "nll_loss"})

_SCATTERS = frozenset(
    {
        aten.scatter.src,
        aten.scatter.value,
        aten.scatter.reduce,
        aten.scatter.value_reduce,
        aten.scatter_add.default,
        aten.scatter_reduce.two,
    }
)
_ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
# Ops an index passes through unchanged in value (an arange's range survives them).
_VALUE_PRESERVING = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten.unsqueeze.default,
        aten.squeeze.dims,
        aten.squeeze.dim,
        aten.squeeze.default,
        aten.expand.default,
        aten.clone.default,
        aten._to_copy.default,
        aten.permute.default,
        aten.slice.Tensor,
        aten.alias.default,
    }
)


@dataclasses.dataclass(frozen=True)
class IndexSite:
    """One checked index of one op: valid values are `low <= index < high`."""

    op: str
    """The op as the user called it (`aten.embedding.default`, `cross_entropy`)."""
    location: str
    """`node_location`: module path, module type and source line."""
    low: int
    high: int
    error: type[Exception]
    message: str
    """torch's message, formatted with `value` (the offending index), `dim`, `size`."""
    dim: int = 0
    message_below: str | None = None
    """torch's message for an index below `low`, where it differs (one_hot's)."""

    def exception(self, value: int, lo: int, hi: int) -> Exception:
        message = self.message_below if value < self.low and self.message_below else self.message
        torch_message = message.format(value=value, dim=self.dim, size=self.high)
        return self.error(
            f"{torch_message}\nzerojax: {self.op} in {self.location} read index {value} "
            f"(this call's indices span {lo}..{hi}; valid: {self.low} <= index < {self.high}). "
            f"The check runs inside the compiled step and raises when the step's results are "
            f"read; config `train.check_index_bounds: false` turns it off."
        )


_OUT_OF_BOUNDS = "index {value} is out of bounds for dimension {dim} with size {size}"


def _user_ops(node: torch.fx.Node) -> frozenset[str]:
    """The ops the user called that this node comes from ('cross_entropy', 'index_add', ...):
    the ATen op torch.export decomposed (`original_aten`, where kept) and the torch function
    it recorded (`torch_fn`)."""
    names = set()
    original = node.meta.get("original_aten")
    if isinstance(original, torch._ops.OpOverload):
        names.add(original._schema.name.split("::", 1)[-1])
    called = _torch_fn_name(node)
    if called is not None:
        names.add(called)
    return frozenset(names)


def _torch_fn_name(node: torch.fx.Node) -> str | None:
    """The torch function torch.export recorded the node under ('cross_entropy'), if any."""
    torch_fn = node.meta.get("torch_fn")
    if isinstance(torch_fn, tuple) and len(torch_fn) == 2:
        return str(torch_fn[1]).rsplit(".", 1)[-1]
    return None


def _user_op(node: torch.fx.Node, *candidates: str) -> str | None:
    """The first of `candidates` among the node's `_user_ops`."""
    found = _user_ops(node)
    return next((name for name in candidates if name in found), None)


def _dim_size(array, dim: int) -> tuple[int, int]:
    """(dim normalised, its size), a 0-d array counting as one element."""
    if array.ndim == 0:
        return 0, 1
    dim = dim % array.ndim
    return dim, int(array.shape[dim])


def _is_index(index) -> bool:
    dtype = getattr(index, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.integer)
        and dtype != jnp.uint8  # uint8 indices are (deprecated) masks in torch
    )


def sites_of(node: torch.fx.Node, args: tuple, kwargs: dict) -> list[tuple[IndexSite, object]]:
    """(site, index array) of every index of `node` torch would check; [] for other ops.
    `args`/`kwargs` are the node's JAX values."""
    target = node.target
    if target == aten.embedding.default:
        weight, indices = args[0], args[1]
        return [
            (_site(node, 0, weight.shape[0], IndexError, "index out of range in self"), indices)
        ]
    if target == aten.index_select.default:
        self, dim, index = args[:3]
        dim, size = _dim_size(self, dim)
        if dim == 1 and self.ndim > 1:  # torch's CPU kernel for dim 1 has its own check
            message = "INDICES element is out of DATA bounds, id={value} axis_dim={size}"
            return [(_site(node, 0, size, RuntimeError, message, dim), index)]
        return [(_site(node, 0, size, IndexError, "index out of range in self", dim), index)]
    if target == aten.gather.default:
        self, dim, index = args[:3]
        dim, size = _dim_size(self, dim)
        if _user_ops(node) & (_NLL_LOSS | _NLL_FUNCTIONS):
            # F.cross_entropy / nll_loss: a gather of the targets, ignored ones replaced by 0.
            site = _site(node, 0, size, IndexError, "Target {value} is out of bounds.", dim)
            return [(dataclasses.replace(site, op=_nll_name(node)), index)]
        return [(_site(node, 0, size, RuntimeError, _OUT_OF_BOUNDS, dim), index)]
    if target in _SCATTERS:
        self, dim, index = args[:3]
        dim, size = _dim_size(self, dim)
        return [(_site(node, 0, size, RuntimeError, _OUT_OF_BOUNDS, dim), index)]
    if target == aten.index_reduce.default:
        self, dim, index = args[:3]
        dim, size = _dim_size(self, dim)
        return [(_site(node, 0, size, IndexError, "index out of range in self", dim), index)]
    if target in (aten.index.Tensor, aten.index_put.default):
        return _advanced_index_sites(node, args[0], args[1])
    if target == aten.put.default:
        self, index = args[:2]
        size = int(np.prod(self.shape))
        message = "out of range: tried to access index {value} on a tensor of {size} elements."
        return [(_site(node, -size, size, IndexError, message), index)]
    if target == aten.eq.Tensor and _user_op(node, "one_hot"):
        return _one_hot_sites(node, args)
    if getattr(target, "__name__", None) == "linear_cross_entropy":
        # The fused linear + cross-entropy (zerojax.bridge.fusion) takes the raw targets.
        weight, target_ids, ignore_index = args[1], args[3], args[4]
        site = _site(node, 0, weight.shape[0], IndexError, "Target {value} is out of bounds.")
        index = jnp.where(target_ids == ignore_index, 0, target_ids)
        return [(dataclasses.replace(site, op=_nll_name(node)), index)]
    return []


def _advanced_index_sites(node, self, indices) -> list:
    """x[i, j] and x[i, j] = v (and what decomposes to them): each index tensor indexes the dim
    at its position; negative indices wrap, except for index_add and index_copy."""
    user_op = _user_op(node, "take", "index_add", "index_copy", "index_fill")
    if user_op == "take":
        size = int(np.prod(self.shape))
        message = "out of range: tried to access index {value} on a tensor of {size} elements."
        return [
            (_site(node, -size, size, IndexError, message), index)
            for index in indices
            if index is not None and _is_index(index)
        ]
    wraps = user_op not in ("index_add", "index_copy")
    error, message = IndexError, _OUT_OF_BOUNDS
    if user_op == "index_add":
        error = RuntimeError
    elif user_op == "index_copy":
        message = "index_copy_(): " + _OUT_OF_BOUNDS
    sites = []
    # torch's x[i] names an index by its place among the index tensors; index_add, index_copy
    # and index_fill (an index_put at [None, .., i]) by the dim they index.
    by_dim = user_op in ("index_add", "index_copy", "index_fill")
    position = 0
    for dim, index in enumerate(indices):
        if index is None or dim >= self.ndim:
            continue
        if _is_index(index):
            size = int(self.shape[dim])
            named = dim if by_dim else position
            sites.append((_site(node, -size if wraps else 0, size, error, message, named), index))
        position += 1
    return sites


def _one_hot_sites(node, args) -> list:
    """F.one_hot decomposes to `eq(unsqueeze(classes, -1), arange(num_classes))`."""
    inputs = node.args[:2]
    for k, other in ((0, 1), (1, 0)):
        producer = inputs[other]
        if isinstance(producer, torch.fx.Node) and producer.target in _ARANGES:
            num_classes = int(args[other].size)
            site = _site(
                node, 0, num_classes, RuntimeError, "Class values must be smaller than num_classes."
            )
            below = "Class values must be non-negative."
            return [(dataclasses.replace(site, op="one_hot", message_below=below), args[k])]
    return []


def _site(node, low, high, error, message, dim=0) -> IndexSite:
    return IndexSite(
        op=str(node.target),
        location=node_location(node),
        low=int(low),
        high=int(high),
        error=error,
        message=message,
        dim=int(dim),
    )


def _nll_name(node) -> str:
    return _torch_fn_name(node) or "nll_loss"


# --- the recorder, inside the trace ----------------------------------------------------------


class IndexBounds:
    """The index checks of one program, filled while the interpreter traces its graph."""

    def __init__(self):
        self.sites: list[IndexSite] = []
        self.extremes: list[jax.Array] = []

    def record(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> None:
        for site, index in sites_of(node, args, kwargs):
            self.add(site, index, node)

    def add(self, site: IndexSite, index, node: torch.fx.Node | None = None) -> None:
        if node is not None and _provably_in_range(node, site):
            return
        if not isinstance(index, jax.core.Tracer):
            # Known now (a constant of the graph, or an op run outside a trace): check now.
            lo, hi = _extremes(np.asarray(index), site, np)
            _raise_for(site, int(lo), int(hi))
            return
        lo, hi = _extremes(index, site, jnp)
        self.sites.append(site)
        self.extremes.append(jnp.stack([lo, hi]))

    def extend(self, sites: list[IndexSite], extremes: list) -> None:
        self.sites.extend(sites)
        self.extremes.extend(extremes)

    def packed(self) -> jax.Array | None:
        """`[table id, lo0, hi0, ...]` (int32), or None when nothing is checked."""
        if not self.sites:
            return None
        table = _table_id(tuple(self.sites))
        return jnp.concatenate([jnp.array([table], jnp.int32), *self.extremes])


def _extremes(index, site: IndexSite, xp):
    """(min, max) of `index`, each with the in-range bound as its initial value: an empty index
    array, or one within bounds, gives values that pass."""
    index = index.astype(xp.int32) if index.dtype != xp.int32 else index
    lo = xp.min(index, initial=site.low)
    hi = xp.max(index, initial=max(site.high - 1, site.low))
    return lo, hi


def _provably_in_range(node: torch.fx.Node, site: IndexSite) -> bool:
    """Whether the checked index is an arange (through views and casts) whose static range
    fits: position ids, one_hot's own arange, iota-built gathers."""
    index_node = _index_node(node)
    while isinstance(index_node, torch.fx.Node) and index_node.target in _VALUE_PRESERVING:
        index_node = index_node.args[0]
    if not (isinstance(index_node, torch.fx.Node) and index_node.target in _ARANGES):
        return False
    val = index_node.meta.get("val")
    numbers = [a for a in index_node.args if isinstance(a, int)]
    if not isinstance(val, torch.Tensor) or len(numbers) != len(index_node.args):
        return False
    if val.dtype.is_floating_point:
        return False
    start, end, step = (
        (0, numbers[0], 1)
        if len(numbers) == 1
        else (numbers[0], numbers[1], numbers[2] if len(numbers) > 2 else 1)
    )
    values = range(start, end, step)
    if not values:
        return True
    return site.low <= min(values[0], values[-1]) and max(values[0], values[-1]) < site.high


def _index_node(node: torch.fx.Node):
    target = node.target
    if target == aten.embedding.default:
        return node.args[1]
    if target in (aten.index_select.default, aten.gather.default, aten.index_reduce.default):
        return node.args[2]
    if target in _SCATTERS:
        return node.args[2]
    return None  # several or unusual indices: always checked


# --- the host side ---------------------------------------------------------------------------

_tables: dict[tuple[IndexSite, ...], int] = {}
_by_id: list[tuple[IndexSite, ...]] = []
_lock = threading.Lock()


def _table_id(sites: tuple[IndexSite, ...]) -> int:
    with _lock:
        found = _tables.get(sites)
        if found is None:
            found = _tables[sites] = len(_by_id)
            _by_id.append(sites)
        return found


def raise_if_out_of_range(vector) -> None:
    """Read a program's packed flag vector (`IndexBounds.packed`) and raise torch's error for
    the first index out of range; nothing when all are in range or `vector` is None."""
    if vector is None:
        return
    values = np.asarray(vector)
    sites = _by_id[int(values[0])]
    for k, site in enumerate(sites):
        _raise_for(site, int(values[1 + 2 * k]), int(values[2 + 2 * k]))


def _raise_for(site: IndexSite, lo: int, hi: int) -> None:
    if lo < site.low:
        raise site.exception(lo, lo, hi)
    if hi >= site.high:
        raise site.exception(hi, lo, hi)
