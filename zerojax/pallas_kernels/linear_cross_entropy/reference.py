"""Linear cross-entropy in plain jnp: the textbook spec and the chunked "xla" implementation.

`linear_cross_entropy_reference` is the spec: it materialises the [tokens, vocab] logits and
lets JAX autodiff do the rest. Tests compare everything against it.

`linear_cross_entropy_xla` is the CPU/TPU fallback and the "xla" implementation of the api.
It walks the vocabulary in chunks of `vocab_chunk` columns with `lax.fori_loop`, so the
largest temporary is [tokens, vocab_chunk] instead of [tokens, vocab]:

- forward: a running max / sum of exponentials (online logsumexp), the target logit and (for
  label smoothing) the sum of logits per token;
- backward (`jax.custom_vjp`): recompute each chunk's logits, form
  dlogits = g * (softmax - (1 - eps) * onehot - eps / vocab) with g the per-token cotangent,
  accumulate dh += dlogits @ W_chunk and write dW_chunk = dlogits.T @ h, db_chunk = sum(dlogits).

The loss per token is (torch `label_smoothing` semantics, eps = label_smoothing)

    loss_i = lse_i - (1 - eps) * z_{i, y_i} - eps / vocab * sum_j z_ij,    lse_i = logsumexp_j z_ij

and 0 for tokens whose label is `ignore_index`. "mean" divides by the number of non-ignored
tokens, as torch does (NaN when every token is ignored, as in torch).

A vocabulary that is not a multiple of the chunk: the last chunk starts at vocab - chunk
(it overlaps the previous one) and the columns it shares with earlier chunks are masked out,
so no weight copy or padding is needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

REDUCTIONS = ("mean", "sum", "none")


def _logits(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    """hidden @ weight.T (+ bias) in fp32 whatever the input dtype."""
    z = lax.dot_general(
        hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    if bias is not None:
        z = z + bias.astype(jnp.float32)[None, :]
    return z


def reduce_per_token_loss(
    per_token: jax.Array, labels: jax.Array, *, ignore_index: int, reduction: str
) -> jax.Array:
    """Apply torch's reduction to a per-token loss that is already 0 at ignored tokens."""
    if reduction == "none":
        return per_token
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    count = jnp.sum(labels != ignore_index).astype(jnp.float32)
    return total / count


def linear_cross_entropy_reference(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> jax.Array:
    """Textbook cross_entropy(hidden @ weight.T + bias, labels), unchunked (the spec).

    hidden [tokens, d], weight [vocab, d], labels int [tokens]; returns fp32.

    >>> loss = linear_cross_entropy_reference(h, w, y)   # doctest: +SKIP
    """
    z = _logits(hidden, weight, bias)
    vocab = z.shape[-1]
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = labels != ignore_index
    safe_labels = jnp.where(valid, labels, 0)
    target = jnp.take_along_axis(z, safe_labels[:, None], axis=-1)[:, 0]
    per_token = lse - (1.0 - label_smoothing) * target
    if label_smoothing:
        per_token = per_token - label_smoothing / vocab * jnp.sum(z, axis=-1)
    per_token = jnp.where(valid, per_token, 0.0)
    return reduce_per_token_loss(per_token, labels, ignore_index=ignore_index, reduction=reduction)


def _chunk_bounds(index: jax.Array, chunk: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Start column of chunk `index` and a mask of the columns it owns.

    The last chunk is clamped to end at `vocab`; its columns below index * chunk belong to
    the previous chunk and are masked so that each column is counted exactly once.
    """
    start = jnp.minimum(index * chunk, vocab - chunk)
    owned = start + jnp.arange(chunk) >= index * chunk
    return start, owned


def _chunk_logits(hidden, weight, bias, start, chunk):
    w = lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
    b = None if bias is None else lax.dynamic_slice_in_dim(bias, start, chunk, axis=0)
    return _logits(hidden, w, b)


def _chunked_forward(hidden, weight, bias, labels, ignore_index, label_smoothing, chunk):
    tokens = hidden.shape[0]
    vocab = weight.shape[0]
    chunk = min(chunk, vocab)
    n_chunks = -(-vocab // chunk)

    def body(i, carry):
        m, s, target, z_sum = carry
        start, owned = _chunk_bounds(i, chunk, vocab)
        z = _chunk_logits(hidden, weight, bias, start, chunk)
        z_masked = jnp.where(owned[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z_masked, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z_masked - m_new[:, None]), axis=-1)
        cols = start + jnp.arange(chunk)
        hit = (cols[None, :] == labels[:, None]) & owned[None, :]
        target = target + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        z_sum = z_sum + jnp.sum(jnp.where(owned[None, :], z, 0.0), axis=-1)
        return m_new, s, target, z_sum

    zeros = jnp.zeros((tokens,), jnp.float32)
    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, target, z_sum = lax.fori_loop(0, n_chunks, body, init)
    lse = m + jnp.log(s)
    per_token = lse - (1.0 - label_smoothing) * target - label_smoothing / vocab * z_sum
    per_token = jnp.where(labels != ignore_index, per_token, 0.0)
    return per_token, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def chunked_per_token_loss(
    hidden: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    ignore_index: int,
    label_smoothing: float,
    vocab_chunk: int,
) -> jax.Array:
    """Per-token loss [tokens] (fp32, 0 at ignored tokens) over vocabulary chunks."""
    per_token, _ = _chunked_forward(
        hidden, weight, bias, labels, ignore_index, label_smoothing, vocab_chunk
    )
    return per_token


def _chunked_fwd(hidden, weight, bias, labels, ignore_index, label_smoothing, vocab_chunk):
    per_token, lse = _chunked_forward(
        hidden, weight, bias, labels, ignore_index, label_smoothing, vocab_chunk
    )
    return per_token, (hidden, weight, bias, labels, lse)


def _chunked_bwd(ignore_index, label_smoothing, vocab_chunk, residuals, g):
    hidden, weight, bias, labels, lse = residuals
    vocab = weight.shape[0]
    chunk = min(vocab_chunk, vocab)
    n_chunks = -(-vocab // chunk)
    # Ignored tokens have loss 0 whatever the logits: their cotangent is dropped here.
    g = jnp.where(labels != ignore_index, g.astype(jnp.float32), 0.0)

    def body(i, carry):
        dh, dw, db = carry
        start, owned = _chunk_bounds(i, chunk, vocab)
        z = _chunk_logits(hidden, weight, bias, start, chunk)
        cols = start + jnp.arange(chunk)
        onehot = (cols[None, :] == labels[:, None]).astype(jnp.float32)
        dz = jnp.exp(z - lse[:, None]) - (1.0 - label_smoothing) * onehot
        if label_smoothing:
            dz = dz - label_smoothing / vocab
        dz = jnp.where(owned[None, :], g[:, None] * dz, 0.0)
        # The matmuls take dlogits in the input dtype (bf16 stays on the fast bf16 path, as
        # torch autocast does); accumulation is fp32.
        dz_in = dz.astype(hidden.dtype)
        w = lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
        dh = dh + jnp.dot(dz_in, w, preferred_element_type=jnp.float32)
        dw_chunk = lax.dot_general(
            dz_in, hidden, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        # Read-add-write: rows the clamped last chunk shares with the previous one get + 0.
        old = lax.dynamic_slice_in_dim(dw, start, chunk, axis=0)
        dw = lax.dynamic_update_slice_in_dim(dw, old + dw_chunk.astype(dw.dtype), start, 0)
        if db is not None:
            old_b = lax.dynamic_slice_in_dim(db, start, chunk, axis=0)
            db = lax.dynamic_update_slice_in_dim(db, old_b + jnp.sum(dz, axis=0), start, 0)
        return dh, dw, db

    init = (
        jnp.zeros(hidden.shape, jnp.float32),
        jnp.zeros(weight.shape, weight.dtype),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    dh, dw, db = lax.fori_loop(0, n_chunks, body, init)
    db = None if bias is None else db.astype(bias.dtype)
    return dh.astype(hidden.dtype), dw, db, None


chunked_per_token_loss.defvjp(_chunked_fwd, _chunked_bwd)


def linear_cross_entropy_xla(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    vocab_chunk: int = 4096,
) -> jax.Array:
    """Chunked linear cross-entropy in plain XLA (no [tokens, vocab] temporary).

    Same contract as `linear_cross_entropy_reference` (hidden [tokens, d]); the public entry
    point with validation is `zerojax.pallas_kernels.linear_cross_entropy.linear_cross_entropy`.

    >>> loss = linear_cross_entropy_xla(h, w, y, vocab_chunk=2048)   # doctest: +SKIP
    """
    per_token = chunked_per_token_loss(
        hidden, weight, bias, labels, ignore_index, float(label_smoothing), vocab_chunk
    )
    return reduce_per_token_loss(per_token, labels, ignore_index=ignore_index, reduction=reduction)
