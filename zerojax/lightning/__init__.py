"""Lightning on zerojax: a Trainer strategy and a Fabric strategy. Importing this module
registers both under the name "zerojax".

    import zerojax.lightning
    trainer = lightning.pytorch.Trainer(strategy=zerojax.lightning.ZeroJaxStrategy("mesh.yaml"))
    trainer = lightning.pytorch.Trainer(strategy="zerojax")           # default config
    fabric = lightning.fabric.Fabric(strategy=zerojax.lightning.ZeroJaxFabricStrategy(cfg))
    fabric.launch()                                  # as for any parallel Fabric strategy
    model, optimizer = fabric.setup(model, optimizer)

The framework's loop stays Lightning's (DESIGN: integrations compose on the user's
framework); the strategy only puts the model on the engine:

- **Where initialize runs.** Trainer: in `strategy.setup`, *after* `configure_optimizers` has
  built the optimizers and LR schedulers from the ordinary parameters (as in any run), as
  `zerojax.initialize(module, optimizers, config)`; the wrapped optimizers share the originals'
  param groups, so the schedulers drive the engine's update. A checkpoint's weights
  (`fit(ckpt_path=...)`) are loaded into the plain module before that, its optimizer state
  after. Without fitting (`Trainer.validate/test/predict`) it initializes with no optimizer; a
  second `fit` of an initialized model wraps the new optimizers on its engine. Fabric:
  `fabric.setup(model, optimizer)` is `zerojax.initialize(model, optimizer, config)`.
- **Which module.** zerojax compiles one module's forward. The Trainer strategy initializes
  the one child holding all the LightningModule's parameters (`self.model`, called from
  `training_step` or from a `forward` that calls it), else the LightningModule itself when it
  defines `forward` (`training_step` calls `self(x)`); `ZeroJaxStrategy(module="path")` names
  it. A submodule of the initialized module called on its own with gradients on (the docs'
  LitAutoEncoder calling `self.encoder(x)`) would run op by op outside the engine, unconnected
  to autograd: it raises an error naming the module instead (`zerojax.lightning.target`).
- **Closures.** Lightning's precision plugin calls `optimizer.step(closure)`; the zerojax
  optimizer runs the closure (training_step + backward) with gradients on, then the update.
  Gradient accumulation is Lightning's (`accumulate_grad_batches`: each backward adds to the
  engine's gradients, the loop divides the loss and steps at the boundary); the config's
  `train.gradient_accumulation_steps` must stay 1. `gradient_clip_val` clips on the shards.
- **Checkpoints** are torch-format state dicts: `state_dict` is the module's, gathered to the
  host (`ZeroModule.state_dict`), `optimizer_states` torch.optim's layout
  (`ZeroOptimizer.state_dict`), so a zerojax checkpoint loads into plain Lightning and back.
- **Processes.** Under torchrun/SLURM zerojax is the data parallelism: each process feeds its
  own rows and the engine averages the gradients. The strategies never wrap in DDP; they
  report the launcher's world size and rank (Lightning's DistributedSampler gives each process
  its share) and serve Lightning's broadcasts and reductions over JAX
  (`zerojax.lightning.collectives`).
- **Precision** is zerojax's policy (the config's `precision:` section); Lightning's plugin stays
  "32-true" (any other is refused with that advice).
- **Devices.** Lightning sees the CPU accelerator: batches stay on the host and the engine puts
  them on its (JAX) devices, GPUs included; Lightning's "GPU available but not used" note on
  such a machine is about torch's devices, which zerojax does not use.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from zerojax.lightning.fabric import ZeroJaxFabricStrategy
from zerojax.lightning.target import training_module
from zerojax.lightning.trainer import ZeroJaxPrecision, ZeroJaxStrategy

__all__ = ["ZeroJaxFabricStrategy", "ZeroJaxPrecision", "ZeroJaxStrategy", "training_module"]

ZeroJaxStrategy.register_strategies(_TRAINER_REGISTRY)
ZeroJaxFabricStrategy.register_strategies(_FABRIC_REGISTRY)
