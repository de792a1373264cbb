"""Flash attention Pallas kernels for the GPU (Triton) lowering: forward, dK/dV and dQ.

FlashAttention-2 (Dao, 2023, https://arxiv.org/abs/2307.08691):

- forward: one program per (q block, batch, q head) streams the key/value blocks through an
  online softmax (running row max `m`, running normalizer `l`), writes the output and the
  per-row logsumexp `lse = m + log(l)` (its Algorithm 1);
- backward: `delta = rowsum(dO * O)` (computed by XLA in `flash_attention_backward`, a fused
  elementwise reduction), then `P = exp(S - lse)` is recomputed block by block:
  one kernel per (k block, batch, kv head) accumulates dK, dV over every q block of every q head
  sharing that kv head (grouped-query attention needs no atomics this way), another per
  (q block, batch, q head) accumulates dQ (its Algorithm 2, split in two so neither needs atomics).

Masks (causal, a boolean or additive [.., seq_q, seq_k] mask, segment ids) become -inf scores.
Fully masked rows are kept NaN-free by shifting with 0 instead of an infinite row max and by
storing `lse = +inf` for them, so the backward recomputes P = exp(-inf) = 0 there.
Dropout regenerates its keep mask from `reference.dropout_keep` (a counter-based hash), so the
three kernels and the reference agree bit for bit on which weights are dropped.

All matmuls accumulate in fp32 (`tile_dot`), the softmax runs in fp32, outputs are stored in
the input dtype.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.compat.jax_api import tile_dot
from zerojax.pallas_kernels.flash_attention.reference import dropout_keep


def _masked_scores(
    q,
    k,
    *,
    scale: float,
    causal: bool,
    q_index,
    k_index,
    mask_block,
    q_segment_ids,
    kv_segment_ids,
):
    """Scaled fp32 scores of one [block_q, block_k] tile with -inf where attention is masked."""
    scores = tile_dot(q, k, trans_b=True) * scale
    allowed = None
    if mask_block is not None:
        if mask_block.dtype == jnp.int8:  # a boolean mask, shipped as int8 (1 = attend)
            allowed = mask_block != 0
        else:
            scores = scores + mask_block.astype(jnp.float32)
    if causal:
        is_past = q_index[:, None] >= k_index[None, :]
        allowed = is_past if allowed is None else jnp.logical_and(allowed, is_past)
    if q_segment_ids is not None:
        same = q_segment_ids[:, None] == kv_segment_ids[None, :]
        allowed = same if allowed is None else jnp.logical_and(allowed, same)
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    return scores


def _dropped(weights, *, seed_ref, batch, head, q_index, k_index, dropout_p: float):
    """Dropout applied to a tile of weights (or of dP): zero the dropped ones, rescale the rest."""
    keep = dropout_keep(
        seed_ref[0], batch, head, q_index[:, None], k_index[None, :], dropout_p=dropout_p
    )
    return jnp.where(keep, weights * (1.0 / (1.0 - dropout_p)), 0.0)


def flash_attention_forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    q_segment_ref,
    kv_segment_ref,
    seed_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    causal: bool,
    dropout_p: float,
    block_k: int,
):
    """One (q block, batch, q head): o_ref [block_q, head_dim_v], lse_ref [block_q] (fp32).

    q_ref [block_q, head_dim]; k_ref/v_ref [seq_k, head_dim(_v)] of the kv head serving this q
    head; mask_ref [block_q, seq_k] (int8 = boolean, or float = additive) or None;
    q_segment_ref [block_q], kv_segment_ref [seq_k] or None; seed_ref [1] uint32 or None.
    """
    block_q = q_ref.shape[0]
    seq_k = k_ref.shape[0]
    q_block, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_index = q_block * block_q + jnp.arange(block_q)
    q = q_ref[...]
    q_segment_ids = None if q_segment_ref is None else q_segment_ref[...]

    def body(k_block, carry):
        acc, row_max, row_sum = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        k_slice = pl.ds(start, block_k)
        k_index = start + jnp.arange(block_k)
        scores = _masked_scores(
            q,
            k_ref[k_slice, :],
            scale=scale,
            causal=causal,
            q_index=q_index,
            k_index=k_index,
            mask_block=None if mask_ref is None else mask_ref[:, k_slice],
            q_segment_ids=q_segment_ids,
            kv_segment_ids=None if kv_segment_ref is None else kv_segment_ref[k_slice],
        )
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        # While a row has seen only masked keys its max is -inf: shift by 0 so exp() gives 0.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp(row_max - shift)
        weights = jnp.exp(scores - shift[:, None])
        # The normalizer sums the weights before dropout (dropout acts on softmax's output).
        row_sum = correction * row_sum + jnp.sum(weights, axis=1)
        if dropout_p > 0.0:
            weights = _dropped(
                weights,
                seed_ref=seed_ref,
                batch=batch,
                head=head,
                q_index=q_index,
                k_index=k_index,
                dropout_p=dropout_p,
            )
        v = v_ref[k_slice, :]
        acc = correction[:, None] * acc + tile_dot(weights.astype(v.dtype), v)
        return acc, new_max, row_sum

    num_k_blocks = seq_k // block_k
    if causal:
        # Key blocks entirely in this q block's future are skipped (top-left aligned causal).
        num_k_blocks = jnp.minimum(
            lax.div((q_block + 1) * block_q + block_k - 1, block_k), num_k_blocks
        )
    acc = jnp.zeros((block_q, o_ref.shape[-1]), jnp.float32)
    row_max = jnp.full((block_q,), -jnp.inf, jnp.float32)
    row_sum = jnp.zeros((block_q,), jnp.float32)
    acc, row_max, row_sum = lax.fori_loop(0, num_k_blocks, body, (acc, row_max, row_sum))
    empty = row_sum == 0.0  # every key masked: output 0 like torch, lse +inf so bwd P = 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, row_sum)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))


def flash_attention_dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    q_segment_ref,
    kv_segment_ref,
    seed_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale: float,
    causal: bool,
    dropout_p: float,
    block_q: int,
    mask_per_head: bool,
):
    """One (k block, batch, kv head): dk_ref [block_k, head_dim], dv_ref [block_k, head_dim_v].

    q_ref/do_ref [groups, seq_q, head_dim(_v)] and lse_ref/delta_ref [groups, seq_q]: the q heads
    served by this kv head; k_ref/v_ref [block_k, head_dim(_v)]; mask_ref [groups or 1, seq_q,
    block_k] or None; q_segment_ref [seq_q], kv_segment_ref [block_k] or None.
    """
    groups, seq_q = q_ref.shape[0], q_ref.shape[1]
    block_k = k_ref.shape[0]
    k_block, batch, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_index = k_block * block_k + jnp.arange(block_k)
    k = k_ref[...]
    v = v_ref[...]
    kv_segment_ids = None if kv_segment_ref is None else kv_segment_ref[...]

    def q_body(group, q_block, carry):
        dk, dv = carry
        start = pl.multiple_of(q_block * block_q, block_q)
        q_slice = pl.ds(start, block_q)
        q_index = start + jnp.arange(block_q)
        q = q_ref[group, q_slice, :]
        do = do_ref[group, q_slice, :]
        mask_block = None
        if mask_ref is not None:
            mask_block = mask_ref[group if mask_per_head else 0, q_slice, :]
        scores = _masked_scores(
            q,
            k,
            scale=scale,
            causal=causal,
            q_index=q_index,
            k_index=k_index,
            mask_block=mask_block,
            q_segment_ids=None if q_segment_ref is None else q_segment_ref[q_slice],
            kv_segment_ids=kv_segment_ids,
        )
        weights = jnp.exp(scores - lse_ref[group, q_slice][:, None])  # P, exact softmax
        d_weights = tile_dot(do, v, trans_b=True)  # dP of the dropped weights
        if dropout_p > 0.0:
            drop = functools.partial(
                _dropped,
                seed_ref=seed_ref,
                batch=batch,
                head=kv_head * groups + group,
                q_index=q_index,
                k_index=k_index,
                dropout_p=dropout_p,
            )
            dropped_weights, d_weights = drop(weights), drop(d_weights)
        else:
            dropped_weights = weights
        dv = dv + tile_dot(dropped_weights.astype(do.dtype), do, trans_a=True)
        # dS = P * (dP - delta), delta = rowsum(dO * O) (FlashAttention-2, eq. in section 3.1).
        d_scores = weights * (d_weights - delta_ref[group, q_slice][:, None])
        dk = dk + tile_dot(d_scores.astype(q.dtype), q, trans_a=True)
        return dk, dv

    # Causal: q blocks entirely before this key block never see it.
    first_q_block = lax.div(k_block * block_k, block_q) if causal else 0

    def group_body(group, carry):
        return lax.fori_loop(
            first_q_block, seq_q // block_q, functools.partial(q_body, group), carry
        )

    dk = jnp.zeros((block_k, dk_ref.shape[-1]), jnp.float32)
    dv = jnp.zeros((block_k, dv_ref.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(0, groups, group_body, (dk, dv))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_attention_dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    q_segment_ref,
    kv_segment_ref,
    seed_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    dbias_ref=None,
    *,
    scale: float,
    causal: bool,
    dropout_p: float,
    block_k: int,
):
    """One (q block, batch, q head): dq_ref [block_q, head_dim]; refs as in the forward kernel.

    dbias_ref [block_q, seq_k] fp32 or None: dS, the gradient of the additive mask's tile
    (S = q k^T * scale + mask, so dL/dmask = dL/dS). Each program owns its rows of the
    [batch, heads_q, seq_q, seq_k] output, so no atomics; the api sums it over the mask's
    broadcast dimensions.
    """
    block_q = q_ref.shape[0]
    seq_k = k_ref.shape[0]
    q_block, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_index = q_block * block_q + jnp.arange(block_q)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_segment_ids = None if q_segment_ref is None else q_segment_ref[...]

    def body(k_block, dq):
        start = pl.multiple_of(k_block * block_k, block_k)
        k_slice = pl.ds(start, block_k)
        k_index = start + jnp.arange(block_k)
        k = k_ref[k_slice, :]
        scores = _masked_scores(
            q,
            k,
            scale=scale,
            causal=causal,
            q_index=q_index,
            k_index=k_index,
            mask_block=None if mask_ref is None else mask_ref[:, k_slice],
            q_segment_ids=q_segment_ids,
            kv_segment_ids=None if kv_segment_ref is None else kv_segment_ref[k_slice],
        )
        weights = jnp.exp(scores - lse[:, None])
        d_weights = tile_dot(do, v_ref[k_slice, :], trans_b=True)
        if dropout_p > 0.0:
            d_weights = _dropped(
                d_weights,
                seed_ref=seed_ref,
                batch=batch,
                head=head,
                q_index=q_index,
                k_index=k_index,
                dropout_p=dropout_p,
            )
        d_scores = weights * (d_weights - delta[:, None])
        if dbias_ref is not None:
            dbias_ref[:, k_slice] = d_scores
        return dq + tile_dot(d_scores.astype(k.dtype), k)

    num_k_blocks = seq_k // block_k
    if causal:
        num_k_blocks = jnp.minimum(
            lax.div((q_block + 1) * block_q + block_k - 1, block_k), num_k_blocks
        )
    dq = jnp.zeros((block_q, dq_ref.shape[-1]), jnp.float32)
    dq = lax.fori_loop(0, num_k_blocks, body, dq)
    if dbias_ref is not None and causal:
        # Key blocks the causal loop skipped are fully masked: their dS is 0 (not stale memory).
        def zero_block(k_block, carry):
            start = pl.multiple_of(k_block * block_k, block_k)
            dbias_ref[:, pl.ds(start, block_k)] = jnp.zeros((block_q, block_k), jnp.float32)
            return carry

        lax.fori_loop(num_k_blocks, seq_k // block_k, zero_block, 0)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _compiler_params(num_warps: int | None, num_stages: int, head_dim: int):
    if num_warps is None:
        # Bigger tiles of a 128-wide head need more warps to keep the fp32 accumulators in
        # registers (the heuristic of the Triton and JAX reference kernels).
        num_warps = 4 if head_dim <= 64 else 8
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _side_inputs_and_specs(mask, segment_ids, seed, *, q_spec_fn, k_spec_fn, mask_spec):
    """(args, in_specs) of the optional mask, segment ids and dropout seed; None when absent."""
    q_segment_ids, kv_segment_ids = (None, None) if segment_ids is None else segment_ids
    args = (mask, q_segment_ids, kv_segment_ids, seed)
    specs = (
        None if mask is None else mask_spec,
        None if q_segment_ids is None else q_spec_fn(),
        None if kv_segment_ids is None else k_spec_fn(),
        None if seed is None else pl.BlockSpec((1,), lambda *_: (0,)),
    )
    return args, specs


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    segment_ids: tuple[jax.Array, jax.Array] | None,
    seed: jax.Array | None,
    *,
    scale: float,
    causal: bool,
    dropout_p: float,
    block_q: int,
    block_k: int,
    num_warps: int | None,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """(out [b, hq, sq, dv] in q's dtype, lse [b, hq, sq] fp32) with the forward kernel.

    Shapes are validated by the api: mask is [b|1, hq|1, sq, sk] int8 (boolean) or float
    (additive), segment ids int32 [b, sq] and [b, sk], seed uint32 [1]; every sequence length a
    multiple of its block.
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    groups = heads_q // heads_kv
    grid = (seq_q // block_q, batch, heads_q)
    mask_spec = None
    if mask is not None:
        mask_batched, mask_per_head = mask.shape[0] > 1, mask.shape[1] > 1
        mask_spec = pl.BlockSpec(
            (None, None, block_q, seq_k),
            lambda i, b, h: (b if mask_batched else 0, h if mask_per_head else 0, i, 0),
        )
    side_args, side_specs = _side_inputs_and_specs(
        mask,
        segment_ids,
        seed,
        q_spec_fn=lambda: pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
        k_spec_fn=lambda: pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
        mask_spec=mask_spec,
    )
    kernel = functools.partial(
        flash_attention_forward_kernel,
        scale=scale,
        causal=causal,
        dropout_p=dropout_p,
        block_k=block_k,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, block_q, head_dim), lambda i, b, h: (b, h, i, 0)),
            pl.BlockSpec((None, None, seq_k, head_dim), lambda i, b, h: (b, h // groups, 0, 0)),
            pl.BlockSpec((None, None, seq_k, head_dim_v), lambda i, b, h: (b, h // groups, 0, 0)),
            *side_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_q, head_dim_v), lambda i, b, h: (b, h, i, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads_q, seq_q, head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32),
        ],
        compiler_params=_compiler_params(num_warps, num_stages, head_dim),
        interpret=interpret,
        name="flash_attention_forward",
    )(q, k, v, *side_args)


def flash_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    segment_ids: tuple[jax.Array, jax.Array] | None,
    seed: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    scale: float,
    causal: bool,
    dropout_p: float,
    block_q_dkv: int,
    block_k_dkv: int,
    block_q_dq: int,
    block_k_dq: int,
    num_warps: int | None,
    num_stages: int,
    interpret: bool,
    with_dbias: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(dq, dk, dv, dbias) from the forward's out and lse; dq, dk, dv in the dtypes of q, k, v.

    dbias (with_dbias, for an additive float mask): fp32 [batch, heads_q, seq_q, seq_k], the
    gradient of the scores, which the caller sums down to the mask's broadcast shape; else None.
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    groups = heads_q // heads_kv
    # delta = rowsum(dO * O): one fused elementwise reduction, left to XLA.
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
    mask_batched = mask is not None and mask.shape[0] > 1
    mask_per_head = mask is not None and mask.shape[1] > 1
    params = _compiler_params(num_warps, num_stages, head_dim)

    # dK, dV: grid over (k block, batch, kv head); each program walks every q head of its group.
    dkdv_mask_spec = None
    if mask is not None:
        dkdv_mask_spec = pl.BlockSpec(
            (None, groups if mask_per_head else 1, seq_q, block_k_dkv),
            lambda j, b, h: (b if mask_batched else 0, h if mask_per_head else 0, 0, j),
        )
    side_args, side_specs = _side_inputs_and_specs(
        mask,
        segment_ids,
        seed,
        q_spec_fn=lambda: pl.BlockSpec((None, seq_q), lambda j, b, h: (b, 0)),
        k_spec_fn=lambda: pl.BlockSpec((None, block_k_dkv), lambda j, b, h: (b, j)),
        mask_spec=dkdv_mask_spec,
    )

    def group_rows(width):  # [groups, seq_q, width]: every q head served by kv head h
        return pl.BlockSpec((None, groups, seq_q, width), lambda j, b, h: (b, h, 0, 0))

    def k_block_rows(width):  # [block_k_dkv, width] of kv head h
        return pl.BlockSpec((None, None, block_k_dkv, width), lambda j, b, h: (b, h, j, 0))

    dk, dv = pl.pallas_call(
        functools.partial(
            flash_attention_dkdv_kernel,
            scale=scale,
            causal=causal,
            dropout_p=dropout_p,
            block_q=block_q_dkv,
            mask_per_head=mask_per_head,
        ),
        grid=(seq_k // block_k_dkv, batch, heads_kv),
        in_specs=[
            group_rows(head_dim),
            k_block_rows(head_dim),
            k_block_rows(head_dim_v),
            *side_specs,
            group_rows(head_dim_v),
            pl.BlockSpec((None, groups, seq_q), lambda j, b, h: (b, h, 0)),
            pl.BlockSpec((None, groups, seq_q), lambda j, b, h: (b, h, 0)),
        ],
        out_specs=[k_block_rows(head_dim), k_block_rows(head_dim_v)],
        out_shape=[jax.ShapeDtypeStruct.like(k), jax.ShapeDtypeStruct.like(v)],
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dkdv",
    )(q, k, v, *side_args, d_out, lse, delta)

    # dQ: grid over (q block, batch, q head), like the forward.
    dq_mask_spec = None
    if mask is not None:
        dq_mask_spec = pl.BlockSpec(
            (None, None, block_q_dq, seq_k),
            lambda i, b, h: (b if mask_batched else 0, h if mask_per_head else 0, i, 0),
        )
    side_args, side_specs = _side_inputs_and_specs(
        mask,
        segment_ids,
        seed,
        q_spec_fn=lambda: pl.BlockSpec((None, block_q_dq), lambda i, b, h: (b, i)),
        k_spec_fn=lambda: pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
        mask_spec=dq_mask_spec,
    )

    def q_block_rows(width):  # [block_q_dq, width] of q head h
        return pl.BlockSpec((None, None, block_q_dq, width), lambda i, b, h: (b, h, i, 0))

    def kv_rows(width):  # [seq_k, width] of the kv head serving q head h
        return pl.BlockSpec((None, None, seq_k, width), lambda i, b, h: (b, h // groups, 0, 0))

    q_block_row = pl.BlockSpec((None, None, block_q_dq), lambda i, b, h: (b, h, i))
    out_specs = [q_block_rows(head_dim)]
    out_shape = [jax.ShapeDtypeStruct.like(q)]
    if with_dbias:
        out_specs.append(q_block_rows(seq_k))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads_q, seq_q, seq_k), jnp.float32))
    dq_and_dbias = pl.pallas_call(
        functools.partial(
            flash_attention_dq_kernel,
            scale=scale,
            causal=causal,
            dropout_p=dropout_p,
            block_k=block_k_dq,
        ),
        grid=(seq_q // block_q_dq, batch, heads_q),
        in_specs=[
            q_block_rows(head_dim),
            kv_rows(head_dim),
            kv_rows(head_dim_v),
            *side_specs,
            q_block_rows(head_dim_v),
            q_block_row,
            q_block_row,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dq",
    )(q, k, v, *side_args, d_out, lse, delta)
    dq, dbias = dq_and_dbias if with_dbias else (dq_and_dbias[0], None)
    return dq, dk, dv, dbias
