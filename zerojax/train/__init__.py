"""Training: initialize(), the wrapped module, the optimizer shim, the precision policy."""

from zerojax.train.initialize import initialize
from zerojax.train.module import ZeroModule
from zerojax.train.optimizer_shim import ZeroOptimizer
from zerojax.train.precision import PrecisionPolicy

__all__ = ["PrecisionPolicy", "ZeroModule", "ZeroOptimizer", "initialize"]
