"""torch -> JAX: capture with torch.export, lower core ATen with zerojax's own table."""

from zerojax.bridge.convert import Converted, Static, convert
from zerojax.bridge.errors import CaptureError, UnsupportedOpError
from zerojax.bridge.registry import lowering, register_lowering, supported_ops

__all__ = [
    "CaptureError",
    "Converted",
    "Static",
    "UnsupportedOpError",
    "convert",
    "lowering",
    "register_lowering",
    "supported_ops",
]
