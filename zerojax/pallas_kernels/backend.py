"""The rule every kernel api applies to `implementation="auto"`."""

import jax


def auto_picks_pallas(interpret: bool) -> bool:
    """ "auto" runs the Pallas kernel on a GPU backend, or on CPU when interpret mode asks for
    it; elsewhere the op's XLA reference (each api also falls back when a shape does not fit)."""
    return interpret or jax.default_backend() == "gpu"
