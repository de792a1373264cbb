"""Sequence parallelism: attention over a sequence split across a mesh axis.

With `sequence_parallel: {axis: sequence}` the engine splits every input's sequence dim over the
`sequence` axis, and XLA keeps the activations between attention blocks split that way (norms,
MLPs, projections and the loss are per token). Attention is the one op that mixes tokens, so
the bridge runs `aten.scaled_dot_product_attention` under `jax.shard_map` over that axis in one
of two ways:

- **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns q/k/v from
  sequence-sharded (every head, L/N tokens) into head-sharded (H/N heads, every token); each
  device runs ordinary attention on its heads over the whole sequence, and the reverse
  all-to-all brings the output back to sequence-sharded. Needs heads % N == 0. Grouped-query
  k/v keep their own head count when it also splits over N (a device's query heads then use
  exactly the kv heads it received); otherwise they are repeated up to the query heads first.
- **Ring attention** (Liu et al. 2023): each device keeps its queries and passes its K/V block
  around the ring with `ppermute`, N - 1 times, merging each block into an online softmax
  (running row max, running sum, rescaled accumulator: the flash-attention recurrence), so no
  device ever holds more than two K/V blocks. Works for any head count.

Causal balance (zig-zag): with a causal mask a contiguous split gives the device holding the
last tokens N times the work of the first. The ring therefore cuts the sequence into 2N chunks
and lets device j hold chunks j and 2N-1-j (an early and a late one); two collective-permutes
of half a shard each move the contiguous shards into that order and two move the output back.
Each ring step is computed as four (query chunk, key chunk) sub-blocks, and a sub-block whose
mask is all False is skipped (`lax.cond`): under a causal mask every device then computes
exactly two sub-blocks per step (three on its own block), the balance the zig-zag buys. The
mask is whatever the model passes (Hugging Face builds an explicit boolean causal mask rather
than `is_causal=True`), sliced per sub-block by the tokens' global positions, so padding and
additive masks are honoured too; a sub-block is skipped only when its mask excludes every pair.

The backward pass is JAX's transpose of these programs (an all-to-all's transpose is the
reverse all-to-all, a ppermute's the reverse permutation). Each ring sub-block is
rematerialised (`jax.checkpoint`) so the backward pass keeps only q, the K/V blocks and the
softmax statistics, not the L/N x L/N probabilities of every step. Ulysses runs each
device's heads through the flash-attention kernel where the config's `kernels.attention` picks
Pallas (GPU; interpret mode in tests), the XLA reference elsewhere; ring attention merges its
blocks with the XLA reference (the kernel returns no softmax statistics to merge).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from zerojax.bridge.kernel_sharding import uses_pallas
from zerojax.config.schema import SEQUENCE_PARALLEL_ATTENTION

__all__ = [
    "SEQUENCE_PARALLEL_ATTENTION",
    "SequenceParallel",
    "sequence_parallel_attention",
]


@dataclass(frozen=True, kw_only=True)
class SequenceParallel:
    """Where attention runs sequence-parallel (`make_parallel_plan` builds it from the
    config's `sequence_parallel` section, as `ParallelPlan.sequence`)."""

    mesh: Mesh
    """The engine's mesh."""

    axis: str = "sequence"
    """The mesh axis the sequence dim is split over."""

    attention: str = "auto"
    """ulysses, ring or auto (`SEQUENCE_PARALLEL_ATTENTION`)."""

    batch_axes: tuple[str, ...] = ()
    """Mesh axes the batch dim is split over: attention runs per batch shard on them."""

    modules: tuple[str, ...] = ()
    """Module path regexes: only attention inside a fully matching module runs split; empty:
    every attention."""

    def __post_init__(self) -> None:
        for axis in (self.axis, *self.batch_axes):
            if axis not in self.mesh.shape:
                raise ValueError(
                    f"SequenceParallel: axis {axis!r} is not in the mesh; mesh axes: "
                    f"{', '.join(self.mesh.axis_names)}"
                )
        if self.axis in self.batch_axes:
            raise ValueError(
                f"SequenceParallel: axis {self.axis!r} splits the sequence and cannot also "
                f"split the batch (batch_axes={self.batch_axes})"
            )
        if self.attention not in SEQUENCE_PARALLEL_ATTENTION:
            raise ValueError(
                f"SequenceParallel: attention={self.attention!r}; allowed: "
                f"{', '.join(SEQUENCE_PARALLEL_ATTENTION)}"
            )

    def covers(self, module_paths: list[str]) -> bool:
        """Whether attention called inside these modules (a node's `nn_module_stack` paths)
        runs sequence-parallel."""
        if not self.modules:
            return True
        return any(re.fullmatch(p, path) for p in self.modules for path in module_paths if path)

    @property
    def size(self) -> int:
        """Devices along the sequence axis (N)."""
        return self.mesh.shape[self.axis]

    def method_for(self, num_heads: int, *, where: str) -> str:
        """The algorithm ("ulysses" or "ring") for attention with `num_heads` query heads."""
        if self.attention == "auto":
            return "ulysses" if num_heads % self.size == 0 else "ring"
        if self.attention == "ulysses" and num_heads % self.size:
            raise ValueError(
                f"sequence_parallel.attention='ulysses': {num_heads} attention heads do not "
                f"split over mesh axis {self.axis}={self.size} ({where}); Ulysses gives each "
                f"device heads/{self.size} heads. Use attention: ring (or auto), or a "
                f"sequence axis size dividing {num_heads}"
            )
        return self.attention


def sequence_parallel_attention(
    placement: SequenceParallel,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    kernel: tuple[str, bool] | None = None,
    where: str,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v as torch's SDPA computes it, with the sequence split
    over `placement.axis` (module docstring).

    query (B, H, L, D), key/value (B, Hk, S, D) with H % Hk == 0 (grouped-query heads are
    served without enable_gqa too); `mask` boolean (True = attend) or additive, broadcastable
    to (B, H, L, S); `causal` top-left aligned. `kernel` is the config's (implementation,
    interpret) for attention: Ulysses runs each device's heads through the flash-attention
    kernel when that choice picks Pallas (ring attention merges blocks with the XLA reference).
    `where` names the op and module for errors.
    """
    batch, heads, length, head_dim = query.shape
    kv_heads, source_length = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"sequence-parallel attention: {heads} query heads are not a multiple of "
            f"{kv_heads} key/value heads ({where})"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    method = placement.method_for(heads, where=where)
    chunks = placement.size * (2 if method == "ring" else 1)
    for name, size in (("query", length), ("key/value", source_length)):
        if size % chunks:
            raise ValueError(
                f"sequence_parallel ({method}): {name} sequence length {size} does not split "
                f"into {chunks} equal chunks over mesh axis {placement.axis}={placement.size} "
                f"({where}); pad the sequence to a multiple of {chunks}"
            )
    if method == "ring" and source_length != length:
        raise ValueError(
            f"sequence_parallel (ring): query length {length} differs from key/value length "
            f"{source_length} ({where}); ring attention splits one sequence for both. Use "
            f"attention: ulysses"
        )
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)

    batch_axes = placement.batch_axes
    batch_split = math.prod(placement.mesh.shape[a] for a in batch_axes)
    batch_spec = batch_axes if batch_axes and batch % batch_split == 0 else None
    seq = PartitionSpec(batch_spec, None, placement.axis, None)
    pallas = False
    if method == "ulysses":
        mask_spec = _mask_spec(mask, batch, batch_spec, heads=(heads, placement.axis))
        pallas = kernel is not None and uses_pallas(*kernel)
        attend = (
            _flash_attend(kernel, causal, scale) if pallas else _reference_attend(causal, scale)
        )
        body = _ulysses_body(placement.axis, placement.size, attend)
    else:
        mask_spec = _mask_spec(mask, batch, batch_spec, rows=(length, placement.axis))
        body = _ring_body(placement.axis, placement.size, causal, scale, mask)
    operands = (query, key, value) + ((mask,) if mask is not None else ())
    in_specs = (seq, seq, seq) + ((mask_spec,) if mask is not None else ())
    # check_vma=False with Pallas: its calls (and their interpret mode) carry no varying axes.
    return jax.shard_map(
        body, mesh=placement.mesh, in_specs=in_specs, out_specs=seq, check_vma=not pallas
    )(*operands)


def _mask_spec(mask, batch, batch_spec, *, heads=None, rows=None) -> PartitionSpec | None:
    """A mask's split: its batch dim as the batch's (when not broadcast), and either its head
    dim (Ulysses) or its query rows (ring) over the sequence axis when it has them in full."""
    if mask is None:
        return None
    entries = [batch_spec if mask.shape[0] == batch else None, None, None, None]
    if heads is not None and mask.shape[1] == heads[0]:
        entries[1] = heads[1]
    if rows is not None and mask.shape[2] == rows[0]:
        entries[2] = rows[1]
    return PartitionSpec(*entries)


# --- Ulysses ---------------------------------------------------------------------------------


def _reference_attend(causal: bool, scale: float):
    from zerojax.bridge.lowerings.attention import attention_reference

    def attend(query, key, value, mask):
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = (jnp.repeat(x, groups, axis=1) for x in (key, value))
        return attention_reference(query, key, value, mask=mask, causal=causal, scale=scale)[0]

    return attend


def _flash_attend(kernel: tuple[str, bool], causal: bool, scale: float):
    from zerojax.pallas_kernels.flash_attention import flash_attention

    implementation, interpret = kernel

    def attend(query, key, value, mask):
        # The kernel serves grouped-query heads itself and never holds the L x L scores.
        return flash_attention(
            query,
            key,
            value,
            mask=mask,
            causal=causal,
            scale=scale,
            implementation=implementation,
            interpret=interpret,
        )

    return attend


def _ulysses_body(axis: str, size: int, attend):
    def body(query, key, value, mask=None):
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % size:
            # Too few kv heads to give every device its own: repeat them up to the query heads
            # (what enable_gqa means), so head chunk d of k/v is the one query chunk d reads.
            key, value = (jnp.repeat(x, heads // kv_heads, axis=1) for x in (key, value))
        # Sequence-sharded -> head-sharded: split heads (dim 1) N ways, gather the sequence.
        query, key, value = (
            lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)
            for x in (query, key, value)
        )
        out = attend(query, key, value, mask)
        # Head-sharded -> sequence-sharded: the reverse exchange.
        return lax.all_to_all(out, axis, split_axis=2, concat_axis=1, tiled=True)

    return body


# --- ring attention ------------------------------------------------------------------------


def _zigzag_destination(chunk: int, size: int) -> int:
    """The device that holds `chunk` of the 2N in zig-zag order: chunk j and 2N-1-j on j."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def to_zigzag(x: jax.Array, dim: int, axis: str, size: int) -> jax.Array:
    """Inside shard_map: device d's contiguous shard (chunks 2d, 2d+1 of 2N) -> its zig-zag
    shard (chunk d, then chunk 2N-1-d), along `dim`."""
    first, second = jnp.split(x, 2, axis=dim)
    even = lax.ppermute(first, axis, [(d, _zigzag_destination(2 * d, size)) for d in range(size)])
    odd = lax.ppermute(
        second, axis, [(d, _zigzag_destination(2 * d + 1, size)) for d in range(size)]
    )
    # Device j's early chunk j is even for even j (it came as `even`), odd otherwise.
    j_even = lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([jnp.where(j_even, even, odd), jnp.where(j_even, odd, even)], axis=dim)


def from_zigzag(x: jax.Array, dim: int, axis: str, size: int) -> jax.Array:
    """The inverse of `to_zigzag`."""
    early, late = jnp.split(x, 2, axis=dim)
    j_even = lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(j_even, early, late), jnp.where(j_even, late, early)
    first = lax.ppermute(even, axis, [(_zigzag_destination(2 * d, size), d) for d in range(size)])
    second = lax.ppermute(
        odd, axis, [(_zigzag_destination(2 * d + 1, size), d) for d in range(size)]
    )
    return jnp.concatenate([first, second], axis=dim)


def zigzag_positions(device: jax.Array, chunk: int, size: int) -> tuple[jax.Array, jax.Array]:
    """Global token positions of the early and the late chunk a device holds in zig-zag order."""
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    return device * chunk + offsets, (2 * size - 1 - device) * chunk + offsets


def _ring_body(axis: str, size: int, causal: bool, scale: float, mask_example):
    mask_rows_split = mask_example is not None and mask_example.shape[2] != 1
    mask_cols_full = mask_example is not None and mask_example.shape[3] != 1
    boolean_mask = mask_example is not None and mask_example.dtype == jnp.bool_

    def body(query, key, value, mask=None):
        chunk = query.shape[2] // 2
        query, key, value = (to_zigzag(x, 2, axis, size) for x in (query, key, value))
        if mask is not None and mask_rows_split:
            mask = to_zigzag(mask, 2, axis, size)
        device = lax.axis_index(axis)
        q_positions = zigzag_positions(device, chunk, size)
        q_halves = jnp.split(query, 2, axis=2)
        mask_halves = (
            jnp.split(mask, 2, axis=2) if mask is not None and mask_rows_split else (mask, mask)
        )
        # Online-softmax state per query half: running max, running sum, unnormalised output.
        # `*_like(query)` keeps the queries' varying mesh axes, which each merged block has
        # too (lax.cond needs its two branches, update and skip, to agree on them).
        state = [
            (
                jnp.full_like(half[..., 0], -jnp.inf, dtype=jnp.float32),
                jnp.zeros_like(half[..., 0], dtype=jnp.float32),
                jnp.zeros_like(half, dtype=jnp.float32),
            )
            for half in q_halves
        ]
        for step in range(size):
            source = (device - step) % size
            kv_positions = zigzag_positions(source, chunk, size)
            k_halves, v_halves = jnp.split(key, 2, axis=2), jnp.split(value, 2, axis=2)
            for qh in range(2):
                for kh in range(2):
                    block_mask = None
                    if mask_halves[qh] is not None:
                        block_mask = mask_halves[qh]
                        if mask_cols_full:
                            block_mask = jnp.take(block_mask, kv_positions[kh], axis=3)
                    state[qh] = _merge_block(
                        state[qh],
                        q_halves[qh],
                        k_halves[kh],
                        v_halves[kh],
                        block_mask,
                        q_positions[qh],
                        kv_positions[kh],
                        causal=causal,
                        boolean_mask=boolean_mask,
                        scale=scale,
                    )
            if step < size - 1:
                # Pass K/V one device along the ring: after step s, device j holds j - s - 1's.
                ring = [(d, (d + 1) % size) for d in range(size)]
                key, value = lax.ppermute((key, value), axis, ring)
        out = jnp.concatenate(
            [_normalise(*state[0][1:]), _normalise(*state[1][1:])], axis=2
        ).astype(query.dtype)
        return from_zigzag(out, 2, axis, size)

    return body


def _normalise(row_sum, acc):
    # Rows whose every key is masked give zeros, as torch's math backend does.
    return jnp.where(
        row_sum[..., None] > 0, acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None], 0.0
    )


def _merge_block(
    state, query, key, value, mask, q_positions, kv_positions, *, causal, boolean_mask, scale
):
    """Fold one (query chunk, key chunk) sub-block into the online softmax `state`; skipped
    (state unchanged) when its mask excludes every pair."""
    allowed = None
    if causal:
        allowed = (q_positions[:, None] >= kv_positions[None, :])[None, None]
    if mask is not None and boolean_mask:
        allowed = mask if allowed is None else jnp.logical_and(allowed, mask)
    bias = mask if mask is not None and not boolean_mask else None

    def update(state, query, key, value, allowed, bias):
        row_max, row_sum, acc = state
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = (jnp.repeat(x, groups, axis=1) for x in (key, value))
        scores = jnp.einsum(
            "bhle,bhse->bhls", query, key, preferred_element_type=jnp.float32
        ) * jnp.float32(scale)
        if bias is not None:
            scores = scores + bias.astype(jnp.float32)
        if allowed is not None:
            scores = jnp.where(allowed, scores, -jnp.inf)
        # The running max only keeps exp() in range; the result does not depend on it, so it
        # carries no gradient (as the reference's row max).
        new_max = lax.stop_gradient(jnp.maximum(row_max, jnp.max(scores, axis=-1)))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(row_max - safe_max)  # 0 where nothing was seen yet (-inf)
        row_sum = rescale * row_sum + jnp.sum(weights, axis=-1)
        acc = rescale[..., None] * acc + jnp.einsum(
            "bhls,bhse->bhle",
            weights.astype(value.dtype),
            value,
            preferred_element_type=jnp.float32,
        )
        return new_max, row_sum, acc

    update = jax.checkpoint(update)
    if allowed is None:
        return update(state, query, key, value, allowed, bias)
    return lax.cond(
        jnp.any(allowed),
        update,
        lambda state, *_: state,
        state,
        query,
        key,
        value,
        allowed,
        bias,
    )
