"""Pallas (Triton GPU lowering) kernels for the fused linear cross-entropy.

Three kernels, none of which materialises the [tokens, vocab] logits in global memory:

- forward (`linear_cross_entropy_fwd_kernel`): grid over token blocks; each program loops over
  the vocabulary in `block_vocab` columns, builds each logits tile with an inner loop over the
  hidden dimension in `block_dim` slices (so a [block_tokens, d] row block never has to fit in
  registers), and keeps an online logsumexp, the target logit and the sum of logits. Writes the
  per-token loss and the logsumexp (the residual for the backward).
- backward dh (`linear_cross_entropy_dh_kernel`): grid over token blocks, loop over vocabulary
  blocks: recompute the logits tile, dlogits = g * (softmax - (1 - eps) onehot - eps / vocab),
  dh[:, k] += dlogits @ W[tile, k] for every hidden slice k. dh is accumulated in fp32 in the
  program's own output rows (read-modify-write; no other program touches them).
- backward dW/db (`linear_cross_entropy_dw_kernel`): grid over vocabulary blocks, loop over
  token blocks: recompute the tile, dW[tile, k] += dlogits.T @ h[:, k], db[tile] += sum(dlogits).

The backward recomputes the logits twice (once per kernel): 5 vocab x tokens x d matmuls in
all against 3 for the unfused loss, the price of never storing the logits and of writing dh
and dW without atomics (deterministic).

Vocabulary not a multiple of `block_vocab`: the last vocabulary tile starts at
vocab - block_vocab (clamped, so every load is in bounds; no weight padding) and its columns
already covered by the previous tile are masked (logits -inf in the forward, dlogits 0 in dh).
The dW kernel computes the clamped tile in full into its own padded output block and
`linear_cross_entropy_bwd` drops the duplicated rows. Tokens must be a multiple of
`block_tokens` (the api pads with ignored tokens); d a multiple of `block_dim`; vocab >=
`block_vocab`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.compat.jax_api import tile_dot


def _tile_start(index, block_vocab: int, vocab: int):
    """First column of vocabulary tile `index`; the last tile is clamped to end at vocab."""
    return jnp.minimum(index * block_vocab, vocab - block_vocab)


def _logits_tile(h_ref, w_ref, b_ref, rows, start, *, block_vocab: int, block_dim: int):
    """fp32 logits [rows, block_vocab] for columns start:start+block_vocab, accumulated over
    hidden slices of block_dim. `rows` is a `pl.ds` of h_ref's rows, or None for all of them
    (passed in, not applied with `.at`, because the Triton lowering takes one indexer per load).
    """
    block_tokens = h_ref.shape[0] if rows is None else rows.size
    rows = slice(None) if rows is None else rows
    dim = h_ref.shape[1]

    def body(k, acc):
        d_slice = pl.ds(pl.multiple_of(k * block_dim, block_dim), block_dim)
        h = h_ref[rows, d_slice]
        w = w_ref[pl.ds(start, block_vocab), d_slice]
        return acc + tile_dot(h, w, trans_b=True)

    acc = jnp.zeros((block_tokens, block_vocab), jnp.float32)
    z = lax.fori_loop(0, dim // block_dim, body, acc)
    if b_ref is not None:
        z = z + b_ref[pl.ds(start, block_vocab)].astype(jnp.float32)[None, :]
    return z


def _zero_columns(ref, *, block_dim: int):
    """Zero a [rows, d] output block slice by slice: Triton loads/stores need power-of-two
    sizes, which d (e.g. 768) need not be."""
    rows, dim = ref.shape

    def body(k, _):
        ref[:, pl.ds(pl.multiple_of(k * block_dim, block_dim), block_dim)] = jnp.zeros(
            (rows, block_dim), ref.dtype
        )

    lax.fori_loop(0, dim // block_dim, body, None)


def _dlogits(z, cols, labels, lse, g, *, label_smoothing: float, vocab: int):
    """g * (softmax - (1 - eps) * onehot - eps / vocab) for one tile, fp32."""
    onehot = (cols[None, :] == labels[:, None]).astype(jnp.float32)
    dz = jnp.exp(z - lse[:, None]) - (1.0 - label_smoothing) * onehot
    if label_smoothing:
        dz = dz - label_smoothing / vocab
    return g[:, None] * dz


def linear_cross_entropy_fwd_kernel(
    h_ref,
    w_ref,
    b_ref,
    labels_ref,
    loss_ref,
    lse_ref,
    *,
    block_vocab: int,
    block_dim: int,
    ignore_index: int,
    label_smoothing: float,
):
    """One token block: per-token loss (0 at ignored tokens) and logsumexp, both fp32."""
    block_tokens = h_ref.shape[0]
    vocab = w_ref.shape[0]
    labels = labels_ref[...]

    def body(j, carry):
        m, s, target, z_sum = carry
        start = _tile_start(j, block_vocab, vocab)
        z = _logits_tile(
            h_ref, w_ref, b_ref, None, start, block_vocab=block_vocab, block_dim=block_dim
        )
        cols = start + jnp.arange(block_vocab)
        owned = cols >= j * block_vocab
        z_owned = jnp.where(owned[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z_owned, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z_owned - m_new[:, None]), axis=1)
        hit = (cols[None, :] == labels[:, None]) & owned[None, :]
        target = target + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        if label_smoothing:
            z_sum = z_sum + jnp.sum(jnp.where(owned[None, :], z, 0.0), axis=1)
        return m_new, s, target, z_sum

    zeros = jnp.zeros((block_tokens,), jnp.float32)
    init = (jnp.full((block_tokens,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, target, z_sum = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), body, init)
    lse = m + jnp.log(s)
    loss = lse - (1.0 - label_smoothing) * target
    if label_smoothing:
        loss = loss - label_smoothing / vocab * z_sum
    loss_ref[...] = jnp.where(labels != ignore_index, loss, 0.0)
    lse_ref[...] = lse


def linear_cross_entropy_dh_kernel(
    h_ref,
    w_ref,
    b_ref,
    labels_ref,
    lse_ref,
    g_ref,
    dh_ref,
    *,
    block_vocab: int,
    block_dim: int,
    label_smoothing: float,
):
    """One token block: dh (fp32) = sum over vocabulary tiles of dlogits @ W_tile.

    g_ref holds the per-token cotangent, already 0 at ignored and padding tokens.
    """
    dim = h_ref.shape[1]
    vocab = w_ref.shape[0]
    labels = labels_ref[...]
    lse = lse_ref[...]
    g = g_ref[...]
    n_dim = dim // block_dim
    _zero_columns(dh_ref, block_dim=block_dim)

    def vocab_body(j, _):
        start = _tile_start(j, block_vocab, vocab)
        z = _logits_tile(
            h_ref, w_ref, b_ref, None, start, block_vocab=block_vocab, block_dim=block_dim
        )
        cols = start + jnp.arange(block_vocab)
        dz = _dlogits(z, cols, labels, lse, g, label_smoothing=label_smoothing, vocab=vocab)
        # Columns the clamped last tile shares with the previous tile were counted there.
        dz = jnp.where((cols >= j * block_vocab)[None, :], dz, 0.0).astype(w_ref.dtype)

        def dim_body(k, _):
            d_slice = pl.ds(pl.multiple_of(k * block_dim, block_dim), block_dim)
            w = w_ref[pl.ds(start, block_vocab), d_slice]
            # Same pointers for the load and the store: each thread re-reads what it wrote.
            dh_ref[:, d_slice] = dh_ref[:, d_slice] + tile_dot(dz, w)

        lax.fori_loop(0, n_dim, dim_body, None)

    lax.fori_loop(0, pl.cdiv(vocab, block_vocab), vocab_body, None)


def linear_cross_entropy_dw_kernel(
    h_ref,
    w_ref,
    b_ref,
    labels_ref,
    lse_ref,
    g_ref,
    dw_ref,
    db_ref,
    *,
    block_tokens: int,
    block_vocab: int,
    block_dim: int,
    label_smoothing: float,
):
    """One vocabulary tile: dW (fp32) = sum over token blocks of dlogits.T @ h, db = sum dlogits.

    dw_ref / db_ref are this program's own [block_vocab, d] / [block_vocab] output block; for
    the clamped last tile it holds columns vocab - block_vocab.. (the caller drops overlap).
    """
    tokens, dim = h_ref.shape
    vocab = w_ref.shape[0]
    j = pl.program_id(0)
    start = _tile_start(j, block_vocab, vocab)
    cols = start + jnp.arange(block_vocab)
    n_dim = dim // block_dim
    _zero_columns(dw_ref, block_dim=block_dim)

    def token_body(i, db):
        t_slice = pl.ds(pl.multiple_of(i * block_tokens, block_tokens), block_tokens)
        z = _logits_tile(
            h_ref, w_ref, b_ref, t_slice, start, block_vocab=block_vocab, block_dim=block_dim
        )
        dz = _dlogits(
            z,
            cols,
            labels_ref[t_slice],
            lse_ref[t_slice],
            g_ref[t_slice],
            label_smoothing=label_smoothing,
            vocab=vocab,
        )
        dz_in = dz.astype(h_ref.dtype)

        def dim_body(k, _):
            d_slice = pl.ds(pl.multiple_of(k * block_dim, block_dim), block_dim)
            h = h_ref[t_slice, d_slice]
            dw_ref[:, d_slice] = dw_ref[:, d_slice] + tile_dot(dz_in, h, trans_a=True)

        lax.fori_loop(0, n_dim, dim_body, None)
        return db + jnp.sum(dz, axis=0)

    db = lax.fori_loop(
        0, tokens // block_tokens, token_body, jnp.zeros((block_vocab,), jnp.float32)
    )
    if db_ref is not None:
        db_ref[...] = db


def _without_bias(kernel):
    """Adapt a kernel whose third ref is b_ref to a pallas_call that has no bias operand."""

    @functools.wraps(kernel)
    def wrapped(h_ref, w_ref, *refs, **kwargs):
        return kernel(h_ref, w_ref, None, *refs, **kwargs)

    return wrapped


def _compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def linear_cross_entropy_fwd(
    hidden: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    *,
    ignore_index: int,
    label_smoothing: float,
    block_tokens: int,
    block_vocab: int,
    block_dim: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Per-token loss and logsumexp, both [tokens] fp32. tokens % block_tokens == 0."""
    tokens, dim = hidden.shape
    vocab = weight.shape[0]
    kernel = functools.partial(
        linear_cross_entropy_fwd_kernel
        if bias is not None
        else _without_bias(linear_cross_entropy_fwd_kernel),
        block_vocab=block_vocab,
        block_dim=block_dim,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    rows = pl.BlockSpec((block_tokens, dim), lambda i: (i, 0))
    per_token = pl.BlockSpec((block_tokens,), lambda i: (i,))
    whole_weight = pl.BlockSpec((vocab, dim), lambda i: (0, 0))
    in_specs = [rows, whole_weight]
    operands = [hidden, weight]
    if bias is not None:
        in_specs.append(pl.BlockSpec((vocab,), lambda i: (0,)))
        operands.append(bias)
    in_specs.append(per_token)
    operands.append(labels)
    out_shape = [jax.ShapeDtypeStruct((tokens,), jnp.float32)] * 2
    return pl.pallas_call(
        kernel,
        grid=(tokens // block_tokens,),
        in_specs=in_specs,
        out_specs=[per_token, per_token],
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="linear_cross_entropy_fwd",
    )(*operands)


def linear_cross_entropy_bwd(
    hidden: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    *,
    label_smoothing: float,
    block_tokens: int,
    block_vocab: int,
    block_dim: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """dh [tokens, d], dW [vocab, d], db [vocab] | None, all fp32.

    g: per-token cotangent [tokens] fp32, already 0 at ignored / padding tokens.
    """
    tokens, dim = hidden.shape
    vocab = weight.shape[0]
    n_vocab_tiles = pl.cdiv(vocab, block_vocab)
    has_bias = bias is not None
    statics = {
        "block_vocab": block_vocab,
        "block_dim": block_dim,
        "label_smoothing": label_smoothing,
    }
    params = _compiler_params(num_warps, num_stages)

    # dh: grid over token blocks.
    rows = pl.BlockSpec((block_tokens, dim), lambda i: (i, 0))
    per_token = pl.BlockSpec((block_tokens,), lambda i: (i,))
    whole_weight = pl.BlockSpec((vocab, dim), lambda i: (0, 0))
    whole_bias = [pl.BlockSpec((vocab,), lambda i: (0,))] if has_bias else []
    bias_operand = [bias] if has_bias else []
    dh_kernel = (
        linear_cross_entropy_dh_kernel
        if has_bias
        else _without_bias(linear_cross_entropy_dh_kernel)
    )
    dh = pl.pallas_call(
        functools.partial(dh_kernel, **statics),
        grid=(tokens // block_tokens,),
        in_specs=[rows, whole_weight, *whole_bias, per_token, per_token, per_token],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((tokens, dim), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="linear_cross_entropy_dh",
    )(hidden, weight, *bias_operand, labels, lse, g)

    # dW, db: grid over vocabulary tiles; each writes its own block of a padded output.
    def all_tokens(shape):
        return pl.BlockSpec(shape, lambda j: (0,) * len(shape))

    whole_bias = [all_tokens((vocab,))] if has_bias else []
    out_specs = [pl.BlockSpec((block_vocab, dim), lambda j: (j, 0))]
    out_shape = [jax.ShapeDtypeStruct((n_vocab_tiles * block_vocab, dim), jnp.float32)]
    if has_bias:
        out_specs.append(pl.BlockSpec((block_vocab,), lambda j: (j,)))
        out_shape.append(jax.ShapeDtypeStruct((n_vocab_tiles * block_vocab,), jnp.float32))
        dw_kernel = linear_cross_entropy_dw_kernel
    else:

        def dw_kernel(h_ref, w_ref, labels_ref, lse_ref, g_ref, dw_ref, **kwargs):
            linear_cross_entropy_dw_kernel(
                h_ref, w_ref, None, labels_ref, lse_ref, g_ref, dw_ref, None, **kwargs
            )

    outs = pl.pallas_call(
        functools.partial(dw_kernel, block_tokens=block_tokens, **statics),
        grid=(n_vocab_tiles,),
        in_specs=[
            all_tokens((tokens, dim)),
            all_tokens((vocab, dim)),
            *whole_bias,
            all_tokens((tokens,)),
            all_tokens((tokens,)),
            all_tokens((tokens,)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="linear_cross_entropy_dw",
    )(hidden, weight, *bias_operand, labels, lse, g)

    # The clamped last tile duplicated `overlap` columns of the previous one: drop them.
    overlap = n_vocab_tiles * block_vocab - vocab
    keep = (n_vocab_tiles - 1) * block_vocab

    def unpad(x):
        return x if overlap == 0 else jnp.concatenate([x[:keep], x[keep + overlap :]], axis=0)

    dw = unpad(outs[0])
    db = unpad(outs[1]) if has_bias else None
    return dh, dw, db
