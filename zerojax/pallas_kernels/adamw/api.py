"""Fused, in-place torch AdamW: the public entry points and the backend dispatch.

`adamw_update` updates one tensor (any shape) in one pass; `adamw_update_sharded` applies it
to a dict of ZeRO/tensor-parallel sharded tensors, each device on its own shard (the update is
elementwise and the scalars replicated, so no collective is needed).

    update = functools.partial(adamw_update, param_dtype=jnp.bfloat16)
    step = jax.jit(update, donate_argnums=(0, 2, 3))  # donate: truly in place
    w, m, v, w_bf16 = step(w, g, m, v, adamw_hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                   weight_decay=0.01, step=1))

Implementations: "pallas" (the Triton kernel of kernel.py; on CPU only with interpret=True),
"xla" (reference.py, what XLA fuses on its own; the CPU/TPU path) and "auto" (pallas on GPU,
else xla). The kernel is not differentiable and needs no VJP: an optimizer step is not traced
by autodiff.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax.pallas_kernels.adamw.kernel import adamw_pallas
from zerojax.pallas_kernels.adamw.reference import adamw_scalars, adamw_update_reference
from zerojax.pallas_kernels.backend import auto_picks_pallas

__all__ = ["AdamWConfig", "adamw_update", "adamw_update_sharded"]

IMPLEMENTATIONS = ("auto", "pallas", "xla")
# Flat offsets inside the kernel are int32.
_MAX_ELEMENTS = 2**31 - 1


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    """Block shape and launch parameters of the fused AdamW kernel.

    >>> AdamWConfig(block_size=2048, num_warps=8)
    """

    block_size: int = 1024
    """Elements per program (power of two). 1024 with 4 warps gives each thread 8 float32, two
    128-bit loads per operand: enough to saturate HBM for a purely streaming kernel."""
    num_warps: int = 4
    """Warps per program (power of two, 1..32)."""
    num_stages: int = 1
    """Software-pipelining stages; there is no loop in this kernel, so 1."""

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.block_size) or self.block_size < 16:
            raise ValueError(f"{self.block_size=} must be a power of two >= 16")
        if not _is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"{self.num_warps=} must be a power of two in [1, 32]")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")


def _resolve_implementation(implementation: str, interpret: bool) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    if implementation == "xla" and interpret:
        raise ValueError(
            "interpret=True runs the Pallas kernel on CPU; it needs implementation='pallas' or"
            " 'auto', not 'xla'"
        )
    if implementation == "auto":
        return "pallas" if auto_picks_pallas(interpret) else "xla"
    return implementation


def _check_operands(weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_dtype) -> None:
    named = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        named["max_exp_avg_sq"] = max_exp_avg_sq
    for name, x in {"weight": weight, **named}.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a real floating array, got dtype {x.dtype}")
    for name, x in named.items():
        if x.shape != weight.shape:
            raise ValueError(
                f"{name}.shape={x.shape} must equal weight.shape={weight.shape} (one AdamW"
                " update per tensor; the moments have the parameter's shape)"
            )
    if param_dtype is not None and not jnp.issubdtype(param_dtype, jnp.floating):
        raise ValueError(f"{param_dtype=} must be a floating dtype (e.g. jnp.bfloat16) or None")
    if weight.size > _MAX_ELEMENTS:
        raise ValueError(
            f"{weight.size=} exceeds {_MAX_ELEMENTS} elements (the kernel's int32 offsets);"
            " shard the tensor (adamw_update_sharded) or use implementation='xla'"
        )


def adamw_update(
    weight: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    hyper: Mapping[str, Any],
    *,
    param_dtype: Any = None,
    implementation: str = "auto",
    interpret: bool = False,
    block_config: AdamWConfig | None = None,
    max_exp_avg_sq: jax.Array | None = None,
    maximize: bool = False,
    decoupled_weight_decay: bool = True,
) -> tuple[jax.Array | None, ...]:
    """One torch AdamW step for one tensor, fused into a single in-place pass.

    Args:
      weight: the float32 master weights, or the parameters themselves when there is no master
        copy (bf16 under a pure-bf16 policy). Any shape.
      grad: the gradient, any float dtype (upcast to float32 in the kernel).
      exp_avg, exp_avg_sq: the moments, float32 or bf16 (math in float32, stored rounded).
      hyper: 0-d scalars `lr, beta1, beta2, eps, weight_decay, step` (step: torch's count after
        the increment, 1 on the first update), plus optionally the float64-derived keys of
        `hyper_from_torch` for bit-exact torch parity (see `reference.REQUIRED_HYPER_KEYS`).
        Traced: a changing lr never recompiles. `adamw_hyper(...)` builds one on the host.
      param_dtype: if given, the same pass also returns the new weight in this dtype (the
        low-precision model copy of a master-weight policy); None returns None there.
      implementation: "pallas", "xla" or "auto" (pallas on GPU, else xla).
      interpret: run the Pallas kernel in interpret mode (CPU).
      block_config: kernel block size and launch parameters (default `AdamWConfig()`).
      max_exp_avg_sq: amsgrad's running maximum of the second moment; enables amsgrad.
      maximize: ascend instead of descend (torch's `maximize=True`).
      decoupled_weight_decay: AdamW's decay (True) or Adam's L2 decay `g += wd * p` (False).

    Returns:
      `(new_weight, new_exp_avg, new_exp_avg_sq, new_param_or_None)`, plus
      `new_max_exp_avg_sq` with amsgrad. The first three (and the fourth input with amsgrad)
      alias their inputs in the Pallas kernel: donate them under `jax.jit` (`donate_argnums`)
      or XLA keeps the inputs alive by copying them first.

    >>> hyper = adamw_hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1)
    >>> w, m, v, w16 = adamw_update(w, g, m, v, hyper, param_dtype=jnp.bfloat16)
    """
    impl = _resolve_implementation(implementation, interpret)
    config = block_config or AdamWConfig()
    _check_operands(weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_dtype)
    if impl == "xla" or weight.size == 0:
        return adamw_update_reference(
            weight,
            grad,
            exp_avg,
            exp_avg_sq,
            hyper,
            param_dtype=param_dtype,
            max_exp_avg_sq=max_exp_avg_sq,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
    scalars = adamw_scalars(hyper, decoupled_weight_decay=decoupled_weight_decay)
    # Row-major reshapes to and from 1-D are free (bitcasts) in XLA.
    flat = [x.reshape(-1) for x in (weight, grad, exp_avg, exp_avg_sq)]
    outputs = adamw_pallas(
        scalars,
        *flat,
        None if max_exp_avg_sq is None else max_exp_avg_sq.reshape(-1),
        param_dtype=param_dtype,
        maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay,
        block_size=config.block_size,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
    )
    outputs = [x.reshape(weight.shape) for x in outputs]
    new_weight, new_exp_avg, new_exp_avg_sq = outputs[:3]
    new_max = outputs[3] if max_exp_avg_sq is not None else None
    new_param = outputs[-1] if param_dtype is not None else None
    result = (new_weight, new_exp_avg, new_exp_avg_sq, new_param)
    return result + ((new_max,) if max_exp_avg_sq is not None else ())


def _check_specs(mesh: Mesh, specs: Mapping[str, P], trees: Mapping[str, Mapping]) -> None:
    for what, tree in trees.items():
        if tree.keys() != specs.keys():
            raise ValueError(
                f"{what} and specs must have the same names; only in {what}:"
                f" {sorted(tree.keys() - specs.keys())[:5]}, only in specs:"
                f" {sorted(specs.keys() - tree.keys())[:5]}"
            )
    for name, spec in specs.items():
        shape = trees["weights"][name].shape
        if len(spec) > len(shape):
            raise ValueError(f"specs[{name!r}]={spec} has more entries than {shape=} has dims")
        for dim, axes in enumerate(spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            ways = 1
            for axis in axes:
                if axis not in mesh.shape:
                    raise ValueError(
                        f"specs[{name!r}]={spec} names mesh axis {axis!r}; the mesh has"
                        f" {tuple(mesh.shape)}"
                    )
                ways *= mesh.shape[axis]
            if shape[dim] % ways:
                raise ValueError(
                    f"specs[{name!r}]={spec}: dim {dim} of {shape=} must be a multiple of {ways}"
                    f" (mesh axes {axes}); pad the parameter or shard another dim"
                )


def adamw_update_sharded(
    weights: Mapping[str, jax.Array],
    grads: Mapping[str, jax.Array],
    exp_avgs: Mapping[str, jax.Array],
    exp_avg_sqs: Mapping[str, jax.Array],
    hyper: Mapping[str, Any],
    *,
    mesh: Mesh,
    specs: Mapping[str, P],
    param_dtype: Any = None,
    implementation: str = "auto",
    interpret: bool = False,
    block_config: AdamWConfig | None = None,
    max_exp_avg_sqs: Mapping[str, jax.Array] | None = None,
    maximize: bool = False,
    decoupled_weight_decay: bool = True,
) -> tuple[Any, ...]:
    """`adamw_update` on every tensor of a dict, shard-locally (`jax.shard_map`).

    `specs[name]` is the PartitionSpec shared by a tensor, its gradient and its moments on
    `mesh` (e.g. `P("fsdp")`, `P()`, `P(None, "tensor")`); `hyper` is replicated. No
    communication: each device updates its own shard. Use it inside the jitted train step,
    with weights and moments donated. Returns `(weights, exp_avgs, exp_avg_sqs, params)` as
    dicts with the inputs' shardings; `params` (the new weights in `param_dtype`) is None when
    `param_dtype` is None. With `max_exp_avg_sqs` (amsgrad) a fifth dict follows.

    >>> specs = {"w": P("fsdp"), "b": P()}
    >>> w, m, v, _ = jax.jit(functools.partial(adamw_update_sharded, mesh=mesh, specs=specs))(
    ...     weights, grads, exp_avgs, exp_avg_sqs, hyper)
    """
    impl = _resolve_implementation(implementation, interpret)
    trees = {"weights": weights, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    amsgrad = max_exp_avg_sqs is not None
    if amsgrad:
        trees["max_exp_avg_sqs"] = max_exp_avg_sqs
    _check_specs(mesh, specs, trees)
    names = sorted(specs)
    specs = {n: specs[n] for n in names}
    hyper = dict(hyper)

    def local_update(hyper, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None):
        results = {
            n: adamw_update(
                weights[n],
                grads[n],
                exp_avgs[n],
                exp_avg_sqs[n],
                hyper,
                param_dtype=param_dtype,
                implementation=impl,
                interpret=interpret,
                block_config=block_config,
                max_exp_avg_sq=max_exp_avg_sqs[n] if amsgrad else None,
                maximize=maximize,
                decoupled_weight_decay=decoupled_weight_decay,
            )
            for n in names
        }
        # Result slots: weight, exp_avg, exp_avg_sq, param (if param_dtype), max (if amsgrad).
        slots = [0, 1, 2] + [3] * (param_dtype is not None) + [4] * amsgrad
        return tuple({n: results[n][i] for n in names} for i in slots)

    operands = [{n: tree[n] for n in names} for tree in trees.values()]
    num_outputs = 3 + (param_dtype is not None) + amsgrad
    outs = jax.shard_map(
        local_update,
        mesh=mesh,
        in_specs=(P(), *[specs] * len(operands)),
        out_specs=(specs,) * num_outputs,
        # pallas_call does not track varying manual axes (vma); the update is elementwise,
        # so there is nothing for the check to catch.
        check_vma=impl == "xla",
    )(hyper, *operands)
    if param_dtype is None:
        outs = (*outs[:3], None, *outs[3:])
    return outs
