"""Lightning's Trainer and Fabric, unchanged, training on zerojax through its strategies.

Run: .venv/bin/python -m pytest -q tests/integrations/test_lightning.py -p no:cacheprovider
Why: issue 26 part 3. `zerojax.lightning.ZeroJaxStrategy` (also `Trainer(strategy="zerojax")`)
must give Lightning's own loop -- `optimizer.step(closure)` from its precision plugin,
`self.log`, an LR scheduler from `configure_optimizers`, `accumulate_grad_batches`,
`gradient_clip_val`, `ModelCheckpoint` and `fit(ckpt_path=...)` -- the numbers plain Lightning
gets on the same seed and data; the Fabric strategy the same for `fabric.setup/backward/
clip_gradients/save/load`. References are plain Lightning / Fabric runs: per-step losses within
1e-5 relative (two float32 runs of one loop differ by reordered sums, ~1e-7 per step, grown
over a dozen AdamW steps to well under 1e-5); final weights normwise over all parameters within
1e-4 (AdamW turns ~1e-7 gradient differences into up to lr-sized steps on near-zero moments,
so per-tensor bounds on small tensors are not meaningful). A resumed run runs the same
programs on the same state as the uninterrupted one, so it matches that one to 1e-6 (the state
passes through the torch-format checkpoint exactly). The examples run as subprocesses.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.fresh_python import run_fresh_python

L = pytest.importorskip("lightning")
zerojax_lightning = pytest.importorskip("zerojax.lightning")

from zerojax.train.module import ZeroModule
from zerojax.train.optimizer_shim import ZeroOptimizer

pytestmark = [
    pytest.mark.multidevice,
    # ~40 s of Lightning Trainer runs: make test-distributed (in CI) runs them, keeping make
    # test under 8 minutes.
    pytest.mark.slow,
    # AutoEncoder has a validation_step (for Trainer.validate); most fits give it no loader.
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no"),
]

REPO = Path(__file__).resolve().parents[2]
ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}


@pytest.fixture(autouse=True)
def _torch_backend_flags_mutable():
    """torch's OpInfo test helpers (tests/bridge imports them into the same pytest worker)
    call `torch.backends.disable_global_flags()`, after which Lightning's Trainer, which sets
    the cudnn flags, raises; a user's process never has that call."""
    with torch.backends.__allow_nonbracketed_mutation():
        yield


ROWS, BATCH = 64, 8  # 8 batches an epoch; with accumulate_grad_batches=2, 4 optimizer steps


def dataset() -> torch.utils.data.TensorDataset:
    """Fresh random rows (classification into 4 classes), the same on every call."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 16, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 4, (ROWS,), generator=generator))


def loader(batch_size: int = BATCH, sampler=None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=batch_size, sampler=sampler)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip


class Classifier(L.LightningModule):
    """The model as one child, called from training_step; AdamW with a per-step schedule."""

    def __init__(self, sync_dist: bool = False):
        super().__init__()
        self.model = mlp()
        self.sync_dist = sync_dist
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.sync_dist)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class AutoEncoder(L.LightningModule):
    """Lightning's docs' LitAutoEncoder, with a forward running both halves (`self(x)`)."""

    def __init__(self, call_submodules: bool = False):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU())
        self.decoder = torch.nn.Linear(8, 16)
        self.call_submodules = call_submodules
        self.losses: list[float] = []

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x_hat = self.decoder(self.encoder(x)) if self.call_submodules else self(x)
        loss = torch.nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer(strategy, **kwargs) -> L.Trainer:
    defaults = {
        "strategy": strategy, "max_steps": -1, "enable_progress_bar": False, "logger": False,
        "enable_model_summary": False, "enable_checkpointing": False, "deterministic": True,
    }  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def flat(state: dict) -> torch.Tensor:
    return torch.cat([state[name].double().flatten() for name in sorted(state)])


def weight_error(mine: dict, reference: dict) -> float:
    assert sorted(mine) == sorted(reference)
    return float((flat(mine) - flat(reference)).norm() / flat(reference).norm())


def fit_classifier(
    strategy, ckpt_path=None, batch_size=BATCH, sampler=None, module=Classifier, **kwargs
) -> Classifier:
    """Two epochs; with automatic optimization, accumulating 2 batches and clipping at 0.5."""
    torch.manual_seed(0)
    module = module()
    options = {"max_epochs": 2}
    if module.automatic_optimization:  # manual optimization does its own
        options.update(accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer(strategy, **{**options, **kwargs}).fit(
        module, loader(batch_size, sampler), ckpt_path=ckpt_path
    )
    return module


def test_trainer_matches_plain_lightning():
    """ZeRO-3 on 8 devices: accumulation, clipping, a step-wise LR schedule, self.log."""
    theirs = fit_classifier("auto")
    ours = fit_classifier(zerojax_lightning.ZeroJaxStrategy(ZERO3))
    assert isinstance(ours.model, ZeroModule)  # the engine ran it, not torch
    assert isinstance(ours.trainer.optimizers[0], ZeroOptimizer)
    assert len(ours.losses) == len(theirs.losses) == 2 * ROWS // BATCH
    torch.testing.assert_close(
        torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=0
    )
    error = weight_error(ours.state_dict(), theirs.state_dict())
    assert error <= 1e-4, error
    # The schedule drove the engine's update: 8 optimizer steps of gamma 0.8.
    assert ours.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.8**8)
    assert float(ours.trainer.callback_metrics["train_loss"]) == pytest.approx(ours.losses[-1])


class ManualClassifier(Classifier):
    """Manual optimization: `self.optimizers()`, `manual_backward`, `clip_gradients`."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler.step()
        self.losses.append(loss.item())


def test_manual_optimization_matches_plain_lightning():
    options = {"max_epochs": 1, "module": ManualClassifier}
    theirs = fit_classifier("auto", **options)
    ours = fit_classifier(zerojax_lightning.ZeroJaxStrategy(ZERO3), **options)
    assert isinstance(ours.model, ZeroModule)
    assert len(ours.losses) == ROWS // BATCH
    torch.testing.assert_close(
        torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=0
    )
    error = weight_error(ours.state_dict(), theirs.state_dict())
    assert error <= 1e-4, error


def test_trainer_by_name_runs_the_lightning_module_forward():
    """Trainer(strategy="zerojax"): no child holds all parameters, so the LightningModule
    (which defines forward) is initialized itself; training_step calls self(x)."""
    runs = {}
    for strategy in ("auto", "zerojax"):
        torch.manual_seed(0)
        module = AutoEncoder()
        trainer(strategy, max_steps=6).fit(module, loader())
        runs[strategy] = module
    assert isinstance(runs["zerojax"], ZeroModule)
    torch.testing.assert_close(
        torch.tensor(runs["zerojax"].losses), torch.tensor(runs["auto"].losses), rtol=1e-5, atol=0
    )
    error = weight_error(runs["zerojax"].state_dict(), runs["auto"].state_dict())
    assert error <= 1e-4, error


def test_validate_alone_initializes_without_optimizer():
    """Trainer.validate on a fresh model: no configure_optimizers, initialize with none."""
    results = {}
    for strategy in ("auto", "zerojax"):
        torch.manual_seed(0)
        module = AutoEncoder()
        results[strategy] = trainer(strategy).validate(module, loader())[0]["val_loss"]
    assert isinstance(module, ZeroModule)
    assert results["zerojax"] == pytest.approx(results["auto"], rel=1e-6)


def test_direct_submodule_call_names_the_module():
    """The docs' pattern, training_step calling self.encoder(x) while zerojax runs the
    LightningModule's forward: an error naming the module and the way out, not torch's
    "element 0 of tensors does not require grad"."""
    torch.manual_seed(0)
    module = AutoEncoder(call_submodules=True)
    with pytest.raises(RuntimeError, match=r"AutoEncoder\.encoder \(Sequential\).*self\(x\)"):
        trainer("zerojax", max_steps=2).fit(module, loader())
    # Without gradients (evaluation) a direct call runs on the live parameters, as in torch;
    # a deepcopy (an EMA model) is an ordinary module.
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = torch.nn.functional.linear(
            torch.relu(x @ module.encoder[0].weight.T + module.encoder[0].bias),
            module.decoder.weight, module.decoder.bias,
        )  # fmt: skip
        torch.testing.assert_close(module.decoder(module.encoder(x)), expected)
    copied = copy.deepcopy(module)
    copied.decoder(copied.encoder(x)).sum().backward()
    assert copied.encoder[0].weight.grad is not None


def test_no_module_to_run_is_a_clear_error():
    class TwoHalves(AutoEncoder):
        forward = L.LightningModule.forward

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"\['encoder', 'decoder'\].*defines no forward"):
        trainer("zerojax", max_steps=2).fit(TwoHalves(), loader())
    with pytest.raises(ValueError, match="Lightning's precision at '32-true'"):
        trainer(zerojax_lightning.ZeroJaxStrategy(), precision="bf16-mixed", max_steps=1).fit(
            Classifier(), loader()
        )


# Lightning's notes on the plain resume below, which runs without the ModelCheckpoint.
@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:Be aware that when using")
def test_resume_from_lightning_checkpoint_continues_like_the_uninterrupted_run(tmp_path):
    """Epoch 1 with ModelCheckpoint, then a fresh model and Trainer resume with
    fit(ckpt_path=...) for epoch 2: the losses and weights of the run that never stopped. The
    checkpoint is torch-format, so plain Lightning resumes from it too."""

    def strategy():
        return zerojax_lightning.ZeroJaxStrategy(ZERO3)

    def checkpoints(directory):
        callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, save_last=True)
        return {"enable_checkpointing": True, "callbacks": [callback]}

    whole = fit_classifier(strategy())
    first = fit_classifier(strategy(), max_epochs=1, **checkpoints(tmp_path))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())
    assert saved["optimizer_states"][0]["state"][0]["exp_avg"].shape == (32, 16)
    resumed = fit_classifier(
        strategy(), ckpt_path=tmp_path / "last.ckpt", **checkpoints(tmp_path / "2")
    )
    assert first.losses + resumed.losses == pytest.approx(whole.losses, rel=1e-6, abs=0)
    error = weight_error(resumed.state_dict(), whole.state_dict())
    assert error <= 1e-6, error
    # Plain Lightning from zerojax's checkpoint goes on as zerojax does.
    plain = fit_classifier("auto", ckpt_path=tmp_path / "last.ckpt")
    torch.testing.assert_close(
        torch.tensor(plain.losses), torch.tensor(resumed.losses), rtol=1e-5, atol=0
    )


# --- Fabric ---------------------------------------------------------------------------------


def fabric_steps(fabric, model, optimizer, batches, losses):
    """Fabric's accumulation idiom: two micro-batches a step, the first under no_backward_sync,
    each loss halved; then clipping and the step."""
    for i, (x, y) in enumerate(batches):
        boundary = i % 2 == 1
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss / 2)
        losses.append(loss.item())
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()


def fabric_run(strategy, path=None, resume=False):
    """Four steps of 2 micro-batches; with `path`, save after two and (`resume`) load there
    into a fresh setup."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()  # Fabric's idiom for any parallel strategy: joins the job (one process here)
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    assert isinstance(model._forward_module, ZeroModule) == (strategy != "auto")
    batches = list(fabric.setup_dataloaders(loader()))
    losses: list[float] = []
    if resume:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        assert state["step"] == 2
        fabric_steps(fabric, model, optimizer, batches[4:], losses)
        return losses, model.state_dict()
    fabric_steps(fabric, model, optimizer, batches[:4], losses)
    if path is not None:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    fabric_steps(fabric, model, optimizer, batches[4:], losses)
    return losses, model.state_dict()


def test_fabric_matches_plain_fabric_and_resumes(tmp_path):
    """ZeRO-3 against plain Fabric; the saved state resumed by `strategy="zerojax"` (the default
    config: ZeRO-0) goes on as the run that never stopped."""
    theirs, their_weights = fabric_run("auto")
    ours, our_weights = fabric_run(
        zerojax_lightning.ZeroJaxFabricStrategy(ZERO3), tmp_path / "state.ckpt"
    )
    assert len(ours) == ROWS // BATCH
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    error = weight_error(our_weights, their_weights)
    assert error <= 1e-4, error
    saved = torch.load(tmp_path / "state.ckpt", weights_only=False)
    assert all(type(v) is torch.Tensor for v in saved["model"].values())
    resumed, resumed_weights = fabric_run("zerojax", tmp_path / "state.ckpt", resume=True)
    assert resumed == pytest.approx(ours[4:], rel=1e-6, abs=0)
    assert weight_error(resumed_weights, our_weights) <= 1e-6


# --- the examples ---------------------------------------------------------------------------


@pytest.mark.slow  # fresh processes (imports, compiles): make test-distributed runs them
@pytest.mark.parametrize("script", ["lightning_train.py", "lightning_fabric_train.py"])
def test_example_trains(script):
    done = run_fresh_python([str(REPO / "examples" / script), "--steps", "8"], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, last = (float(v) for v in done.stdout.split("loss ")[-1].split()[:3:2])
    assert last < first, done.stdout[-2000:]


class TinyGPT2(L.LightningModule):
    """Hugging Face GPT-2 as the one child; its own loss (`labels=`) takes zerojax's fused
    forward-backward program, whose loss cotangent is Lightning's 1/accumulate_grad_batches."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.gpt2 = transformers.GPT2LMHeadModel(config)
        self.losses: list[float] = []
        self.validation_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.gpt2(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.gpt2(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss)
        self.validation_losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_tiny_gpt2_with_validation_matches_plain_lightning():
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(2))
    tokens = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    runs = {}
    for name, strategy in (("auto", "auto"), ("zerojax", zerojax_lightning.ZeroJaxStrategy(ZERO3))):
        torch.manual_seed(0)
        module = TinyGPT2()
        options = {"max_epochs": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 1.0}
        trainer(strategy, num_sanity_val_steps=0, **options).fit(module, tokens, tokens)
        runs[name] = module
    ours, theirs = runs["zerojax"], runs["auto"]
    assert isinstance(ours.gpt2, ZeroModule)
    assert len(ours.losses) == 8 and len(ours.validation_losses) == 8
    for mine, reference in (
        (ours.losses, theirs.losses),
        (ours.validation_losses, theirs.validation_losses),
    ):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference), rtol=1e-5, atol=0)
    error = weight_error(ours.state_dict(), theirs.state_dict())
    assert error <= 1e-4, error


# --- several processes (torchrun) -----------------------------------------------------------


def torchrun_main(out: Path) -> None:
    """This module as a torchrun script: rank r's Trainer run, saved to out/rank<r>.pt."""
    from zerojax import distributed

    config = {
        "devices": {"platform": "cpu", "num_cpu_devices": 4},  # 2 processes x 4 = 8 devices
        "mesh": {"data": -1},
        "zero_stage": 3,
        "runtime": {"compilation_cache_dir": None},
    }
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)
    module = fit_classifier(
        zerojax_lightning.ZeroJaxStrategy(config),
        max_epochs=1,
        module=lambda: Classifier(sync_dist=True),  # self.log's mean over processes
        enable_checkpointing=True,  # rank 0's directory broadcast, rank 0 writes
        callbacks=[checkpoint],
    )
    torch.save(
        {
            "losses": module.losses,
            "logged": float(module.trainer.callback_metrics["train_loss"]),
            "state_dict": module.state_dict(),
            "sampler": type(module.trainer.train_dataloader.sampler).__name__,
            "indices": list(module.trainer.train_dataloader.sampler),
        },
        out / f"rank{distributed.rank()}.pt",
    )


@pytest.mark.slow
def test_torchrun_two_processes_match_one_plain_process(tmp_path):
    """2 processes x 4 devices: Lightning's DistributedSampler gives each process its share of
    the (shuffled) rows, 8 a batch (no DDP wrapping: the engine averages the gradients), so the
    mean of the ranks' losses is plain Lightning's loss on the batch of both ranks' 16 rows,
    and the weights are its weights."""
    from tests.distributed.torchrun import check_ok, torchrun

    check_ok(torchrun(Path(__file__), "--out", str(tmp_path), nproc=2, timeout=300))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(rank["sampler"] == "DistributedSampler" for rank in ranks)
    shares = [rank["indices"] for rank in ranks]
    assert sorted(shares[0] + shares[1]) == list(range(ROWS))  # each row on one process
    both = [i for k in range(0, ROWS // 2, BATCH) for share in shares for i in share[k : k + BATCH]]
    reference = fit_classifier("auto", max_epochs=1, batch_size=2 * BATCH, sampler=both)
    assert len(ranks[0]["losses"]) == len(reference.losses) == ROWS // (2 * BATCH)
    mean = (torch.tensor(ranks[0]["losses"]) + torch.tensor(ranks[1]["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(reference.losses), rtol=1e-5, atol=0)
    assert weight_error(ranks[1]["state_dict"], ranks[0]["state_dict"]) == 0
    for rank in ranks:  # self.log(sync_dist=True) reduced over the processes
        assert rank["logged"] == pytest.approx(float(mean[-1]), rel=1e-6)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert weight_error(saved["state_dict"], ranks[0]["state_dict"]) == 0
    error = weight_error(ranks[0]["state_dict"], reference.state_dict())
    assert error <= 1e-4, error


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    torchrun_main(parser.parse_args().out)
