"""Row tiling shared by the LayerNorm and RMSNorm Pallas kernels (GPU / Triton lowering).

Both ops flatten ``x`` to ``[n_rows, n_features]`` and give each program whole rows, so the row
statistics never leave registers. The feature block is ``n_features`` rounded up to a power of two
(Triton tensors must have power-of-two sizes); the tail columns, and the rows past ``n_rows`` in
the last block, are masked on every load and store, so any feature dimension works without
padding copies in HBM.

An operand or output is described by a ``Block`` kind, which fixes its BlockSpec (and, for an
output, its shape); an absent one (None) reaches the kernel as a None ref, so one kernel body
serves every combination of optional weight, bias and statistics.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


class Block(enum.Enum):
    ROWS = "rows"  # [rows_per_program, padded]: whole rows of x, y, g, dx
    FEATURES = "features"  # [padded], the same for every program: weight, bias
    STATS = "stats"  # [rows_per_program]: one fp32 value per row (mean, rstd)
    # [padded] fp32, one row per program: partial parameter gradients. Summed over programs with
    # XLA after the call, which needs no atomics and so stays deterministic.
    PARTIALS = "partials"


def tile_masks(row_start, block_rows: int, n_rows: int, padded: int, n_features: int):
    """Validity of the rows and columns of one ``[block_rows, padded]`` tile."""
    row_ok = row_start + jnp.arange(block_rows) < n_rows
    col_ok = jnp.arange(padded) < n_features
    return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def load_features(ref, col_ok):
    """A ``[padded]`` parameter row in fp32 (zero in the padding), or None without the ref."""
    if ref is None:
        return None
    return plgpu.load(ref, mask=col_ok, other=0.0).astype(jnp.float32)


def fold_tiles(body, init, *, program_rows: int, block_rows: int, n_rows: int, n_features: int):
    """Walk this program's ``program_rows`` rows in tiles of ``block_rows``.

    ``body(rows, row_ok, mask, carry) -> carry`` gets the tile's row slice of the program's
    blocks and its masks; the carry accumulates the partial parameter gradients in registers, so
    a program writes one partial row however many tiles it covers.
    """
    padded = pl.next_power_of_2(n_features)
    program_start = pl.program_id(0) * program_rows

    def tile(t, carry):
        start = pl.multiple_of(t * block_rows, block_rows)
        row_ok, _, mask = tile_masks(program_start + start, block_rows, n_rows, padded, n_features)
        return body(pl.ds(start, block_rows), row_ok, mask, carry)

    return lax.fori_loop(0, program_rows // block_rows, tile, init)


def row_tiled_call(
    kernel: Callable,
    inputs: Sequence[tuple[jax.Array | None, Block]],
    outputs: Sequence[tuple[jnp.dtype, Block] | None],
    *,
    rows_per_program: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
    **statics,
) -> list[jax.Array | None]:
    """Run ``kernel(*input_refs, *output_refs, n_rows=, n_features=, **statics)`` on x's rows.

    ``inputs[0]`` is ``x [n_rows, n_features]``, which fixes the tiling. A None input or output
    passes a None ref; the result lists the outputs in order, None where absent, with PARTIALS
    already summed over programs (fp32 ``[n_features]``).
    """
    n_rows, n_features = inputs[0][0].shape
    padded = pl.next_power_of_2(n_features)
    n_programs = pl.cdiv(n_rows, rows_per_program)
    specs = {
        Block.ROWS: pl.BlockSpec((rows_per_program, padded), lambda i: (i, 0)),
        Block.FEATURES: pl.BlockSpec((padded,), lambda i: (0,)),
        Block.STATS: pl.BlockSpec((rows_per_program,), lambda i: (i,)),
        Block.PARTIALS: pl.BlockSpec((pl.squeezed, padded), lambda i: (i, 0)),
    }
    shapes = {
        Block.ROWS: (n_rows, n_features),
        Block.STATS: (n_rows,),
        Block.PARTIALS: (n_programs, n_features),
    }
    present_inputs = [(a, kind) for a, kind in inputs if a is not None]
    present_outputs = [o for o in outputs if o is not None]
    present = tuple(a is not None for a, _ in inputs) + tuple(o is not None for o in outputs)

    def body(*refs):
        it = iter(refs)
        all_refs = (next(it) if p else None for p in present)
        kernel(*all_refs, n_rows=n_rows, n_features=n_features, **statics)

    outs = iter(
        pl.pallas_call(
            body,
            grid=(n_programs,),
            in_specs=[specs[kind] for _, kind in present_inputs],
            out_specs=[specs[kind] for _, kind in present_outputs],
            out_shape=[jax.ShapeDtypeStruct(shapes[kind], dt) for dt, kind in present_outputs],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name=name,
        )(*(a for a, _ in present_inputs))
    )
    return [
        None if o is None else (next(outs).sum(axis=0) if o[1] is Block.PARTIALS else next(outs))
        for o in outputs
    ]


__all__ = ["Block", "fold_tiles", "load_features", "row_tiled_call", "tile_masks"]
