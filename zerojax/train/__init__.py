"""Training: initialize(), the wrapped module, the optimizer shim, the precision policy, the step."""
