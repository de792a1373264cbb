"""Where an engine's arrays live and how torch's values cross into them and back: one strategy
per engine, chosen once when it is built (`placement_kind`), and called for every placement
decision after that, so no other code asks how many processes there are or whether values exist.

- `SingleProcess`: one process sees every device and feeds the whole batch. Inputs are split
  over the batch axes (replicated when they do not divide), outputs go to torch zero-copy where
  that is safe (`hand_over`).
- `ManyProcesses` (torchrun, SLURM: `jax.process_count() > 1`): each process feeds its own rows,
  as under PyTorch's `DistributedDataParallel`; the engine's arrays are global
  (`zerojax.distributed.arrays`). Its semantics are below.
- `Abstract` (planning: `Engine(abstract=True)`, `zerojax plan --devices N`): shapes with their
  shardings (`jax.ShapeDtypeStruct`) stand for the arrays, read off the module's tensors (a model
  on `meta` has no values); programs are compiled, never run; nothing reads a value, so nothing
  waits on the host. It never meets a torch call.

DDP semantics with several processes (`ManyProcesses`):

- inputs: each process's tensors are its local batch (dim 0); the global batch is their
  concatenation in process order, assembled with `jax.make_array_from_process_local_data` (no
  host holds it). Tensors without a batch dim (0-d) must be equal on every process.
- outputs: an output whose dim 0 is a multiple of the global batch is split by rows like the
  inputs, and `model(x)` returns this process's rows; any other output (a loss the model
  computes itself, batch statistics) is over the global batch, the same on every process.
- gradients: DDP's gradient is the average over processes of each one's local-loss gradient,
  (1/P) sum_p dL_p/dw. The program's pullback of the processes' row cotangents, concatenated,
  is sum_p dL_p/dw, so each row cotangent is divided by P before it (exact for P a power of
  two). An output that is not split by rows has one value for the whole job: its cotangent,
  which every process must pass equally (JAX checks), enters once, which is the average of P
  equal ones. A loss the model computes over the global batch (`loss_fn=`, HF `labels=`) is
  its mean over all rows: its gradient equals DDP's whenever each process's loss is the mean
  over an equal number of rows (not so with per-process counts of ignored tokens).
- loss kwargs: a model called with `num_items_in_batch` (the Hugging Face Trainer's loss
  kwargs, the number of items the loss is normalised by over all processes) computes a sum
  over the global batch divided by it, whose DDP value on each process is its own rows' sum
  divided by it: the processes' shares, which the caller adds up (the Trainer multiplies each
  by P before DDP averages the gradients, and averages the logged values). Each process gets
  the global loss divided by P: the shares add up to the same loss and the same gradient
  (its cotangent divided by P alike); one process's share is not its own rows' part.
- input gradients (a wrapped model feeding torch) are per process in DDP, dL_p/dx_p: the
  pullback gave (1/P) of that, so they are multiplied back by P.
- BatchNorm in train mode normalises over the global batch, as `SyncBatchNorm` does.

Parameters are checked equal on every process when placed (`place_same_everywhere`), as DDP
broadcasts rank 0's: build the model identically on every rank (same seed). The dropout seed is
rank 0's.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from zerojax.bridge.convert import state_arrays
from zerojax.bridge.dtypes import from_torch, to_jax_dtype, to_torch
from zerojax.distributed.arrays import (
    batch_dim_sharding,
    data_parallel_process_count,
    global_from_local,
    local_rows,
    place_same_everywhere,
)
from zerojax.sharding.zero import ShardingPlan

log = logging.getLogger("zerojax")

__all__ = [
    "Abstract",
    "ManyProcesses",
    "Placement",
    "SingleProcess",
    "abstract_state",
    "hand_over",
    "placement_kind",
]


def placement_kind(*, abstract: bool) -> type[Placement]:
    """The engine's placement: `Abstract` for planning, else by the job's process count."""
    if abstract:
        return Abstract
    return ManyProcesses if jax.process_count() > 1 else SingleProcess


class Placement(abc.ABC):
    """How one engine places its state and its inputs, and hands values back to torch.

    Built from the engine's `ShardingPlan`; `module_state`, which the plan is made from, is a
    classmethod. `global_rows` is the batch size of one call (`global_rows(inputs)`), which the
    output and gradient conversions of that call take back. The methods with a body here are
    the placement of values in one process; each kind overrides what it does otherwise."""

    num_processes: int = 1
    """Processes feeding their own rows of each batch (DDP's world size)."""

    def __init__(self, plan: ShardingPlan):
        self.plan = plan
        self.replicated = NamedSharding(plan.mesh, PartitionSpec())

    # --- the training state ----------------------------------------------------------------

    @classmethod
    def module_state(cls, module: torch.nn.Module) -> tuple[dict, dict, dict]:
        """(params, buffers, alias) of `module`: its arrays keyed by canonical state_dict name,
        and every name -> the canonical one (`state_arrays`)."""
        return state_arrays(module)

    @abc.abstractmethod
    def place_state(
        self,
        arrays: Mapping[Hashable, Any],
        shardings: Mapping[Hashable, Sharding],
        dtypes: Mapping[Hashable, Any],
    ) -> dict:
        """`module_state` values as the engine's state: each on `shardings[key]`, a float one
        cast to `dtypes[key]` (None: kept), always a copy of the module's value."""

    def put(self, array, sharding: Sharding):
        """A value of the state (a JAX or host array) on `sharding`; itself if already there."""
        if isinstance(array, jax.Array) and array.sharding == sharding:
            return array
        return jax.device_put(array, sharding)

    def job_seed(self, seed: int) -> int:
        """The seed every process uses (dropout masks must agree across the job)."""
        return seed

    def place_rng(self, rng: jax.Array) -> jax.Array:
        """The engine's rng key as the state holds it."""
        return rng

    def make_state(self, make: Callable, *args):
        """State computed by a program from state (`make`, jitted with its shardings)."""
        return make(*args)

    def all_finite(self, finite) -> bool:
        """The update program's finite-gradients flag on the host: a host-device sync."""
        return bool(finite)

    def filled(self, like, value, sharding: Sharding | None = None):
        """An array of `like`'s shape and dtype holding `value`, on `sharding` (None: JAX's
        default device, uncommitted)."""
        if sharding is None:
            return jnp.full(like.shape, value, like.dtype)
        return jax.device_put(np.full(like.shape, value, like.dtype), sharding)

    # --- torch values in -------------------------------------------------------------------

    def trace_example(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Torch inputs with the shapes the program will see, for torch.export to specialize on."""
        return args, kwargs

    def value_of(self, tensor: torch.Tensor):
        """A torch tensor as the engine reads it: a JAX copy of its values."""
        return from_torch(tensor)

    @abc.abstractmethod
    def shard_input(self, array) -> jax.Array:
        """One input of a model call, placed for the program."""

    def global_rows(self, jax_leaves) -> int | None:
        """The batch size of one call, where outputs are split by rows (None: not split)."""
        return None

    # --- torch values out ------------------------------------------------------------------

    @abc.abstractmethod
    def outputs_to_torch(self, leaves: list, kept, global_rows: int | None) -> list[torch.Tensor]:
        """A program's output arrays as the torch tensors `model(x)` returns; `kept`: the arrays
        the engine holds on to (an output that is one of them must be copied)."""

    @abc.abstractmethod
    def cotangent(self, spec: jax.ShapeDtypeStruct, grad, global_rows: int | None) -> jax.Array:
        """The pullback's cotangent for the output `spec` (its shape and dtype) from torch's
        gradient of it (None: zeros)."""

    @abc.abstractmethod
    def input_grads_to_torch(self, grads, global_rows: int | None) -> list[torch.Tensor]:
        """The pullback's input gradients as the torch gradients of the inputs."""

    def loss_share(self, kwargs: Mapping) -> float:
        """The factor on a loss the model computed over the global batch, as `model(x)` hands it
        over, and on its gradient (see "loss kwargs" above)."""
        return 1.0


class SingleProcess(Placement):
    """One process: every device and the whole batch are this process's."""

    def __init__(self, plan: ShardingPlan):
        super().__init__(plan)
        self._warned_uneven: set[tuple] = set()

    def place_state(self, arrays, shardings, dtypes):
        keys = list(arrays)
        values = [_host_copy(arrays[k], dtypes.get(k)) for k in keys]
        placed = jax.device_put(values, [shardings[k] for k in keys])
        return dict(zip(keys, placed, strict=True))

    def shard_input(self, array):
        """Batch inputs are split over the data axes when their batch dim divides evenly.

        An uneven batch (the last one of an epoch, say) is replicated instead: every device
        computes it whole, with the same result, at data-parallel-size times the work. It is
        logged once per shape, since every such batch compiles its own programs."""
        sharding = self.plan.input_sharding(array.ndim)
        mesh = self.plan.mesh
        for dim, axes in enumerate(sharding.spec):
            if axes is None:
                continue
            size = int(np.prod([mesh.shape[a] for a in np.atleast_1d(axes)]))
            if array.shape[dim] % size:
                if array.shape not in self._warned_uneven:
                    self._warned_uneven.add(array.shape)
                    log.warning(
                        "zerojax: input of shape %s: dim %d (size %d) does not split over %s=%d; "
                        "it is replicated (every device computes the whole batch). Use a batch "
                        "size that is a multiple of %d to keep data parallelism.",
                        array.shape,
                        dim,
                        array.shape[dim],
                        "x".join(np.atleast_1d(axes).tolist()),
                        size,
                        size,
                    )
                return jax.device_put(array, self.replicated)
        return jax.device_put(array, sharding)

    def outputs_to_torch(self, leaves, kept, global_rows):
        return hand_over(leaves, kept)

    def cotangent(self, spec, grad, global_rows):
        if grad is None or not jnp.issubdtype(spec.dtype, jnp.floating):
            return jnp.zeros(spec.shape, spec.dtype)
        return from_torch(grad).astype(spec.dtype)

    def input_grads_to_torch(self, grads, global_rows):
        # Fresh outputs of the backward program: handed over like the forward's.
        return hand_over(list(grads), kept=())


class ManyProcesses(Placement):
    """Several processes, each feeding its own rows (DDP semantics: the module docstring)."""

    def __init__(self, plan: ShardingPlan):
        if plan.batch_dim != 0:
            raise ValueError(
                f"inputs.batch_dim={plan.batch_dim}: with several processes the batch must be "
                "dim 0 of every input (each process's rows are stacked along it)"
            )
        super().__init__(plan)
        self.num_processes = data_parallel_process_count(plan.input_sharding(1))

    def _row_sharding(self, ndim: int) -> NamedSharding:
        return batch_dim_sharding(self.plan.input_sharding(ndim), ndim)

    # --- the training state ----------------------------------------------------------------

    def place_state(self, arrays, shardings, dtypes):
        # One call for the whole state: checked equal on every process in one collective.
        return place_same_everywhere(
            {k: _host_copy(a, dtypes.get(k)) for k, a in arrays.items()}, shardings
        )

    def put(self, array, sharding):
        if isinstance(array, jax.Array) and array.sharding == sharding:
            return array
        if (
            isinstance(array, jax.Array)
            and array.is_fully_addressable
            and not sharding.is_fully_addressable
        ):
            # A host-local array (a loaded state_dict) is this process's copy of the global
            # value; device_put takes that from host memory (and checks the processes agree),
            # not from a device array.
            array = np.asarray(array)
        return jax.device_put(array, sharding)

    def job_seed(self, seed):
        return int(multihost_utils.broadcast_one_to_all(np.int64(seed)))  # rank 0's

    def place_rng(self, rng):
        """A global (replicated) key, which Orbax can save."""
        if not rng.is_fully_addressable:
            return rng
        key_data = np.asarray(jax.random.key_data(rng))
        return jax.random.wrap_key_data(
            jax.device_put(key_data, self.replicated), impl=jax.random.key_impl(rng)
        )

    # --- torch values in -------------------------------------------------------------------

    def trace_example(self, args, kwargs):
        """Each process's rows repeated P times: the global batch's shapes."""

        def widen(t: torch.Tensor) -> torch.Tensor:
            return t.repeat(self.num_processes, *[1] * (t.ndim - 1)) if t.ndim else t

        return torch_pytree.tree_map_only(torch.Tensor, widen, (args, kwargs))

    def shard_input(self, array):
        """This process's input tensor (host data) as the global batch."""
        local = np.asarray(array)
        return global_from_local(local, self.plan.input_sharding(local.ndim), self.num_processes)

    def global_rows(self, jax_leaves):
        """Dim 0 of the call's first batch-split input."""
        for leaf in jax_leaves:
            if isinstance(leaf, jax.Array) and leaf.ndim and not leaf.is_fully_addressable:
                return leaf.shape[0]
        return None

    # --- torch values out ------------------------------------------------------------------

    @staticmethod
    def _is_rows(leaf, global_rows: int | None) -> bool:
        """Whether an output (an array or its ShapeDtypeStruct) holds the batch's rows."""
        shape = leaf.shape
        return bool(global_rows and shape and shape[0] and shape[0] % global_rows == 0)

    def _local_output(self, leaf: jax.Array, global_rows: int | None) -> np.ndarray:
        """This process's share of one output: its rows, or the whole of a non-row output."""
        if self._is_rows(leaf, global_rows):
            return local_rows(leaf, self._row_sharding(leaf.ndim))
        if not leaf.is_fully_replicated:
            leaf = jax.device_put(leaf, self.replicated)
        return np.asarray(leaf)

    def outputs_to_torch(self, leaves, kept, global_rows):
        return [to_torch(self._local_output(x, global_rows)) for x in leaves]

    def cotangent(self, spec, grad, global_rows):
        rows = self._is_rows(spec, global_rows)
        if grad is None or not np.issubdtype(spec.dtype, np.floating):
            shape = (spec.shape[0] // self.num_processes, *spec.shape[1:]) if rows else spec.shape
            grad = np.zeros(shape, spec.dtype)
        else:
            grad = np.asarray(from_torch(grad)).astype(spec.dtype)
        if rows:
            grad = (grad / np.asarray(self.num_processes, grad.dtype)).astype(spec.dtype)
            return global_from_local(grad, self._row_sharding(spec.ndim), self.num_processes)
        try:
            return jax.device_put(grad, self.replicated)
        except AssertionError as exc:  # JAX's check that every process passed the same value
            raise ValueError(
                f"the gradient of a model output of shape {spec.shape} that is not split by rows "
                "(the same value on every process) differs between processes; its cotangent "
                "must be equal on every rank"
            ) from exc

    def input_grads_to_torch(self, grads, global_rows):
        """DDP's per-process input gradients, P times the pullback's rows."""
        out = []
        for grad in grads:
            local = self._local_output(grad, global_rows)
            out.append(
                to_torch((local * np.asarray(self.num_processes, local.dtype)).astype(local.dtype))
            )
        return out

    def loss_share(self, kwargs):
        return 1.0 / self.num_processes if "num_items_in_batch" in kwargs else 1.0


class Abstract(Placement):
    """Shapes with shardings for arrays: programs compile and never run; no value is read."""

    @classmethod
    def module_state(cls, module):
        return abstract_state(module)

    def place_state(self, arrays, shardings, dtypes):
        def shape(key, a):
            dtype = dtypes.get(key)
            return jax.ShapeDtypeStruct(
                a.shape, dtype if dtype is not None and _is_float(a) else a.dtype
            )

        return {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k])
            for k, s in ((k, shape(k, a)) for k, a in arrays.items())
        }

    def make_state(self, make, *args):
        return jax.eval_shape(make, *args)

    def all_finite(self, finite):
        return True  # no values: the plan is of the update applied

    def filled(self, like, value, sharding=None):
        """The shape alone: `like` itself, or on `sharding`."""
        if sharding is None:
            return like
        return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)

    def value_of(self, tensor):
        """Its shape and dtype (a meta tensor has no values)."""
        return jax.ShapeDtypeStruct(tuple(tensor.shape), to_jax_dtype(tensor.dtype))

    def shard_input(self, array):
        """The shape with the batch sharding the engine would feed."""
        shape = tuple(array.shape)
        return jax.ShapeDtypeStruct(
            shape, array.dtype, sharding=self.plan.input_sharding(len(shape))
        )

    def outputs_to_torch(self, leaves, kept, global_rows):
        raise _no_values()

    def cotangent(self, spec, grad, global_rows):
        raise _no_values()

    def input_grads_to_torch(self, grads, global_rows):
        raise _no_values()


def _no_values() -> TypeError:
    return TypeError(
        "zerojax: an abstract engine (Engine(abstract=True), for planning) holds shapes, not "
        "values: it cannot run a torch call; build the engine without abstract=True to train"
    )


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _host_copy(array, dtype):
    """What is placed, in `dtype` (floats only): a host copy, so placing never reuses the
    converted module's buffers (a replicated device_put could, and the first update's donation
    would then invalidate them)."""
    return np.asarray(array.astype(dtype) if dtype is not None and _is_float(array) else array)


def abstract_state(module: torch.nn.Module):
    """`state_arrays` as shapes: (params, buffers, alias) with `jax.ShapeDtypeStruct` values,
    read off the module's tensors' shapes and dtypes (no values: `meta` tensors do)."""
    _, _, alias = state_arrays(module, read_values=False)

    def shapes(named):
        return {
            n: jax.ShapeDtypeStruct(tuple(t.shape), to_jax_dtype(t.dtype))
            for n, t in named
            if t is not None and alias.get(n) == n
        }

    params = shapes(module.named_parameters(remove_duplicate=False))
    return params, shapes(module.named_buffers(remove_duplicate=False)), alias


# dtypes DLPack carries between JAX and torch as they are (others, e.g. float8, are copied).
_DLPACK_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        np.float16, np.float32, np.float64, jnp.bfloat16, np.int8, np.int16, np.int32,
        np.int64, np.uint8, np.bool_, np.complex64, np.complex128,
    )
)  # fmt: skip


def hand_over(leaves: list, kept) -> list[torch.Tensor]:
    """The program's output arrays as torch tensors, zero-copy where that is safe.

    A single-device CPU output whose buffer is its own is handed to torch through DLPack: the
    tensor *is* the buffer, so an output the loop never reads (the logits next to the loss)
    costs nothing, and one it reads costs no copy. Nothing in JAX reads that buffer again, so
    torch may also change it in place. Its own: XLA gives every output of an executable a
    distinct, fresh buffer (no donation on the forward programs), so the only way an output can
    share one is to *be* an array the engine keeps -- one of `kept` (state, inputs, residuals),
    were JAX ever to forward an input to an output -- or to appear twice among the outputs;
    those, like sharded or replicated outputs (a host array must be assembled anyway), are
    copied (`to_torch`). Identity, not buffer addresses, is checked against `kept`: it costs
    microseconds for the ~200 residual arrays of a GPT-2 pullback where addresses cost ms.
    """
    zero_copy = [_single_cpu_buffer(x) for x in leaves]
    if any(zero_copy):
        kept_ids = {id(x) for x in jax.tree.leaves(kept)}
        seen: set[int] = set()
        for i, leaf in enumerate(leaves):
            if zero_copy[i]:
                address = leaf.unsafe_buffer_pointer()
                zero_copy[i] = id(leaf) not in kept_ids and address not in seen
                seen.add(address)
    return [torch.from_dlpack(x) if z else to_torch(x) for x, z in zip(leaves, zero_copy)]


def _single_cpu_buffer(x) -> bool:
    return (
        isinstance(x, jax.Array)
        and x.size > 0
        and x.dtype in _DLPACK_DTYPES
        and len(x.sharding.device_set) == 1
        and next(iter(x.sharding.device_set)).platform == "cpu"  # type: ignore[attr-defined]
    )
