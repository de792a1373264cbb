"""zerojax: an ordinary PyTorch model and training loop as one sharded JAX/XLA program."""

from zerojax.bridge import CaptureError, Converted, UnsupportedOpError, convert

__version__ = "0.1.0"
__all__ = ["CaptureError", "Converted", "UnsupportedOpError", "convert"]
