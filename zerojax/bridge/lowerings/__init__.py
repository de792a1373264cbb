"""Lowerings, one module per op family; importing this package registers them all."""

from zerojax.bridge.lowerings import (  # noqa: F401
    attention,
    conv,
    creation,
    distance,
    indexing,
    matmul,
    moe,
    norm,
    patches,
    pointwise,
    pooling,
    random,
    reduction,
    resample,
    shape,
    spectral,
    symbolic,
)
