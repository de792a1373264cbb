"""torch -> JAX: capture with torch.export, lower core ATen with zerojax's own table."""

from zerojax.bridge.convert import Converted, convert
from zerojax.bridge.errors import CaptureError, UnsupportedOpError
from zerojax.bridge.registry import lowering, supported_ops

__all__ = [
    "CaptureError",
    "Converted",
    "UnsupportedOpError",
    "convert",
    "lowering",
    "supported_ops",
]
