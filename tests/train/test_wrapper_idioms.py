"""What scripts do to a model besides calling it: unwrap it, pickle it whole, `torch.compile` it,
`save_pretrained` it, hook it and its optimizer before wrapping.

Run: .venv/bin/python -m pytest -q tests/train/test_wrapper_idioms.py -p no:cacheprovider
Why: issue 43. timm's `unwrap_model` (`while hasattr(model, "module")`) recursed forever on a
`.module` that was the model itself; `torch.save(model)` of a wrapped LSTM language model
(pytorch/examples' word_language_model) raised a PicklingError; `torch.compile(model)`
(nanoGPT's default) failed in capture; `save_pretrained` wrote `ZeroJaxLlamaForCausalLM` into
`config.json`; optimizer hooks registered before `initialize` never fired, and a top-level
forward hook ran twice (traced into the program and again around it). Each test fails without
the change it names, and compares with a plain-torch twin on the same inputs.
"""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import GPT2, MLP, GPT2Config
from tests import tolerances
from tests.fresh_python import run_fresh_python
from tests.third_party.word_language_model.model import RNNModel
from zerojax.train.live_tensor import LiveTensor

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
BATCH = 8


def mlp_twins(optimizer_class=torch.optim.SGD, config=ZERO3):
    """(model, its optimizer, plain twin, the twin's optimizer), the same initial values."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    optimizer = optimizer_class(module.parameters(), lr=0.05)
    ref_optimizer = optimizer_class(reference.parameters(), lr=0.05)
    model, optimizer = zerojax.initialize(module, optimizer, config)
    return model, optimizer, reference, ref_optimizer


def mlp_steps(pairs, steps=2):
    """`steps` identical SGD steps of each (model, optimizer) pair, each model fed the batch in
    its parameters' dtype (a float64 copy beside); their losses."""
    losses = []
    for _ in range(steps):
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        for model, optimizer in pairs:
            loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def assert_same_state(got: dict, expected: dict):
    """A few fp32 steps of the MLP (widths 32/64, batch 8) on both sides differ by reordered
    sums, ~1e-7 relative per step: 1e-5 relative with a 1e-6 floor."""
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert type(got[name]) is torch.Tensor, (name, type(got[name]))
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# --- model.module and the unwrap loops ------------------------------------------------------


def hasattr_loop(model):
    """The loop in many codebases (`while hasattr(model, "module")`), stopped at 10 levels."""
    for _ in range(10):
        if not hasattr(model, "module"):
            return model
        model = model.module
    raise AssertionError("`while hasattr(model, 'module')` did not stop")


def unwrappers():
    """How the ecosystem unwraps a model: name -> function."""
    found = {"hasattr loop": hasattr_loop}
    try:
        import timm.utils

        found["timm.utils.unwrap_model"] = timm.utils.unwrap_model
    except ImportError:
        pass
    try:
        from accelerate.utils import extract_model_from_parallel

        found["accelerate extract_model_from_parallel"] = extract_model_from_parallel
        found["accelerate extract_model_from_parallel(recursive=True)"] = lambda model: (
            extract_model_from_parallel(model, recursive=True)
        )
    except ImportError:
        pass
    try:
        import transformers.modeling_utils

        unwrap_model = transformers.modeling_utils.unwrap_model
        found["transformers unwrap_model"] = unwrap_model

        def without_accelerate(model):  # its own `hasattr(model, "module")` recursion
            available = transformers.modeling_utils.is_accelerate_available
            transformers.modeling_utils.is_accelerate_available = lambda: False
            try:
                return unwrap_model(model)
            finally:
                transformers.modeling_utils.is_accelerate_available = available

        found["transformers unwrap_model without accelerate"] = without_accelerate
    except ImportError:
        pass
    try:
        from lightning.fabric.wrappers import _unwrap_objects

        found["lightning _unwrap_objects"] = _unwrap_objects
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("name", list(unwrappers()))
def test_unwrap_loops_stop_at_the_users_module(name):
    """Each unwrapper returns the model (or its `.module`), which trains the same, reads the
    same state and runs the same forward as plain torch's model."""
    unwrap = unwrappers()[name]
    model, optimizer, reference, ref_optimizer = mlp_twins()
    mlp_steps([(model, optimizer), (reference, ref_optimizer)])
    unwrapped = unwrap(model)
    assert isinstance(unwrapped, MLP)
    assert_same_state(unwrapped.state_dict(), reference.state_dict())
    x = torch.randn(BATCH, 32)
    torch.testing.assert_close(unwrapped(x), reference(x), rtol=1e-5, atol=1e-6)
    # Through torch.compile's wrapper too (timm and accelerate look for `_orig_mod`; accelerate
    # keeps the compiled wrapper by default): it stops, at the model or around it.
    unwrapped = unwrap(torch.compile(model))
    inner = getattr(unwrapped, "_orig_mod", unwrapped)
    assert isinstance(inner, MLP)
    assert_same_state(inner.state_dict(), reference.state_dict())


def test_module_is_ddps_module():
    """DDP's `model.module`: the same module on every read, whose state, forward, mode and
    submodules are the model's, and whose trained state_dict loads into plain torch."""
    model, optimizer, reference, ref_optimizer = mlp_twins()
    raw_model = model.module
    assert raw_model is model.module and isinstance(raw_model, MLP)
    assert not hasattr(raw_model, "module")
    mlp_steps([(model, optimizer), (reference, ref_optimizer)])
    buffer = io.BytesIO()
    torch.save(raw_model.state_dict(), buffer)
    buffer.seek(0)
    plain = MLP()
    plain.load_state_dict(torch.load(buffer))
    assert_same_state(plain.state_dict(), reference.state_dict())
    raw_model.eval()
    assert not model.training and not model.fc1.training
    x = torch.randn(BATCH, 32)
    torch.testing.assert_close(raw_model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert raw_model.fc1 is model.fc1 and raw_model.fc1.weight is model.fc1.weight


# --- whole-module pickling ------------------------------------------------------------------


# The classes word_language_model's main.py allows when it loads the model it saved.
RNN_MODEL_CLASSES = [
    RNNModel,
    torch.nn.modules.dropout.Dropout,
    torch.nn.modules.linear.Linear,
    torch.nn.modules.rnn.GRU,
    torch.nn.modules.rnn.LSTM,
    torch.nn.modules.rnn.RNN,
    torch.nn.modules.sparse.Embedding,
]


def word_language_model(rnn_type: str) -> RNNModel:
    """pytorch/examples' word_language_model RNNModel (tests/third_party), small."""
    torch.manual_seed(0)
    return RNNModel(rnn_type, ntoken=50, ninp=16, nhid=16, nlayers=2, dropout=0.0)


def rnn_steps(pairs, steps=2):
    """`steps` identical SGD steps of a (seq, batch) language model pair; their losses."""
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 50, (6, BATCH))
        targets = torch.randint(0, 50, (6 * BATCH,))
        for model, optimizer in pairs:
            hidden = model.init_hidden(BATCH)
            output, _ = model(tokens, hidden)
            loss = F.nll_loss(output, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def saved_whole(model, how: str):
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        # word_language_model's own load: weights_only (torch's default), its classes allowed.
        with torch.serialization.safe_globals(RNN_MODEL_CLASSES):
            return torch.load(io.BytesIO(buffer.getvalue()))
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    return copy.deepcopy(model)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "copy.deepcopy"])
@pytest.mark.parametrize("rnn_type", ["LSTM", "GRU"])
@pytest.mark.long
def test_whole_model_pickles_as_an_ordinary_module(rnn_type, how):
    """word_language_model's `torch.save(model, f)` after training, loaded as it loads it
    (`weights_only`, its classes allowed): an instance of the user's own class (no zerojax
    class, no live tensors) with the trained values, running as plain torch's. It raised
    PicklingError ("args[0] from __newobj__ args has the wrong class")."""
    module = word_language_model(rnn_type)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model, optimizer = zerojax.initialize(module, optimizer, ZERO3)
    rnn_steps([(model, optimizer), (reference, ref_optimizer)])
    for source in (model, model.module):
        loaded = saved_whole(source, how)
        assert type(loaded) is RNNModel and type(loaded.rnn) is type(reference.rnn)
        tensors = [*loaded.parameters(), *loaded.buffers(), *loaded.rnn._flat_weights]
        assert not any(isinstance(t, LiveTensor) for t in tensors)
        # The LSTM's flat weights are its parameters (torch's cuDNN path reads them).
        assert all(w is p for w, p in zip(loaded.rnn._flat_weights, loaded.rnn.parameters()))
        expected = {n: t.detach() for n, t in reference.state_dict().items()}
        assert_same_state(loaded.state_dict(), expected)
        # The loaded model trains on as plain torch's does.
        loaded_optimizer = torch.optim.SGD(loaded.parameters(), lr=0.5)
        twin = copy.deepcopy(reference)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
        ours, theirs = rnn_steps([(loaded, loaded_optimizer), (twin, twin_optimizer)], 1)
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert type(model) is not RNNModel  # the model itself still runs through zerojax


FRESH_LOAD = """
import sys, torch
from tests.third_party.word_language_model.model import RNNModel
nn = torch.nn
classes = [RNNModel, nn.Dropout, nn.Linear, nn.GRU, nn.LSTM, nn.RNN, nn.Embedding]
with torch.serialization.safe_globals(classes):  # as word_language_model loads it
    model = torch.load(sys.argv[1])
expected = torch.load(sys.argv[2])
assert type(model).__name__ == "RNNModel", type(model)
for name, value in expected.items():
    torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
tokens = torch.load(sys.argv[3])
model.eval()
output, _ = model(tokens, model.init_hidden(tokens.shape[1]))
torch.save(output, sys.argv[4])
assert not any(name.startswith("zerojax") or name.startswith("jax") for name in sys.modules)
print("ok")
"""


@pytest.mark.parametrize("rnn_type", ["LSTM"])
@pytest.mark.long
def test_torch_save_of_the_model_loads_in_plain_torch(rnn_type, tmp_path):
    """The file `torch.save(model, f)` writes loads in a process that never imports zerojax
    (or JAX), with the values zerojax trained, and evaluates as plain torch's model; no zerojax
    name is in it."""
    module = word_language_model(rnn_type)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model, optimizer = zerojax.initialize(module, optimizer, ZERO3)
    rnn_steps([(model, optimizer), (reference, ref_optimizer)])
    with open(tmp_path / "model.pt", "wb") as f:
        torch.save(model, f)
    assert b"zerojax" not in (tmp_path / "model.pt").read_bytes().lower()
    torch.save(model.state_dict(), tmp_path / "state.pt")
    tokens = torch.randint(0, 50, (6, BATCH))
    torch.save(tokens, tmp_path / "tokens.pt")
    script = tmp_path / "load.py"
    script.write_text(FRESH_LOAD)
    files = [str(tmp_path / name) for name in ("model.pt", "state.pt", "tokens.pt", "out.pt")]
    done = run_fresh_python([str(script), *files], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reference.eval()
    expected, _ = reference(tokens, reference.init_hidden(BATCH))
    # Two 2-step float32 runs: ~1e-7 relative weight differences through a 2-layer RNN.
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=1e-5, atol=1e-5)


# --- torch.compile ----------------------------------------------------------------------------


def gpt_losses(compile_how: str | None, zerojax_config=None, steps=4):
    """nanoGPT's loop on bench's GPT-2: AdamW, `model = torch.compile(model)` after the model
    (and after `initialize`), clipping; the losses and `raw_model.state_dict()`."""
    torch.manual_seed(1337)
    model = GPT2(GPT2Config(vocab_size=128, max_seq_len=32, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-3, betas=(0.9, 0.95))
    if zerojax_config is not None:
        model, optimizer = zerojax.initialize(model, optimizer, zerojax_config)
    if compile_how == "torch.compile":
        model = torch.compile(model)
    elif compile_how == "model.compile":
        model.compile()
    raw_model = model
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 128, (BATCH, 32), generator=batches)
        y = torch.randint(0, 128, (BATCH, 32), generator=batches)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, raw_model.state_dict()


@pytest.mark.parametrize("compile_how", ["torch.compile", "model.compile"])
@pytest.mark.long
def test_torch_compile_of_a_zerojax_model_trains_as_torch(compile_how):
    """`model = torch.compile(model)` after `initialize` (nanoGPT's `compile=True`), and
    `model.compile()`: the engine's program runs as it is, with plain torch eager's losses
    (1e-5 relative: reordered float32 sums, ~1e-7 a step, over 4 AdamW steps); the compiled
    wrapper's state_dict has torch's `_orig_mod.` keys, the values plain torch trained."""
    theirs, their_state = gpt_losses(None)
    ours, our_state = gpt_losses(compile_how, ZERO3)
    assert ours == pytest.approx(theirs, rel=1e-5)
    prefix = "_orig_mod." if compile_how == "torch.compile" else ""
    assert sorted(our_state) == sorted(prefix + name for name in their_state)
    unprefixed = {name.removeprefix(prefix): value for name, value in our_state.items()}
    # Normwise over all weights (as tests/train/test_hf_trainer.py): AdamW turns ~1e-7
    # gradient differences into up to lr-sized steps on near-zero moments, so per-tensor bounds
    # on small tensors mean nothing; 1e-4 of the whole.
    names = sorted(their_state)
    flat = lambda state: torch.cat([state[n].double().flatten() for n in names])
    error = float((flat(unprefixed) - flat(their_state)).norm() / flat(their_state).norm())
    assert error <= 1e-4, error


# --- hooks registered before initialize -------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer_class",
    [torch.optim.AdamW, torch.optim.RMSprop],
    ids=["compiled-update", "torch-step-on-live-tensors"],
)
def test_optimizer_step_hooks_fire_once_per_step(optimizer_class):
    """Step pre/post hooks registered on the optimizer before `initialize` (they were lost on
    the compiled path), one registered after, and the global `register_optimizer_step_post_hook`
    (it fired twice on the live path): each fires once per step, in plain torch's order."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    optimizer = optimizer_class(module.parameters(), lr=0.01)
    ref_optimizer = optimizer_class(reference.parameters(), lr=0.01)
    fired = []

    def hook(what):
        return lambda opt, args, kwargs: fired.append(what)

    for opt in (optimizer, ref_optimizer):
        opt.register_step_pre_hook(hook("pre"))
        opt.register_step_post_hook(hook("post"))
    model, optimizer = zerojax.initialize(module, optimizer, ZERO3)
    for opt in (optimizer, ref_optimizer):
        opt.register_step_post_hook(hook("post, registered after"))
    handle = register_optimizer_step_post_hook(hook("global"))
    logs = {}
    try:
        for name, (m, opt) in {
            "ours": (model, optimizer),
            "torch": (reference, ref_optimizer),
        }.items():
            fired.clear()
            x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
            F.cross_entropy(m(x), y).backward()
            opt.step()
            logs[name] = list(fired)
    finally:
        handle.remove()
    assert logs["ours"] == logs["torch"] == ["pre", "post", "post, registered after", "global"]


def test_optimizer_hooks_registered_before_initialize_fire_with_the_same_updates():
    """The user's hooks, registered before `initialize`, on a fresh pair: a pre-hook that
    changes the learning rate (a warm-up written as a hook) takes effect as in torch."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    exact = copy.deepcopy(module).double()
    triples = []
    for m in (module, reference, exact):
        opt = torch.optim.AdamW(m.parameters(), lr=0.0)
        steps = []

        def warm_up(opt, args, kwargs, steps=steps):
            steps.append(1)
            for group in opt.param_groups:
                group["lr"] = 0.01 * len(steps)

        opt.register_step_pre_hook(warm_up)
        triples.append((m, opt, steps))
    model, optimizer = zerojax.initialize(module, triples[0][1], ZERO3)
    (_, _, our_steps), (_, ref_optimizer, ref_steps), (_, exact_optimizer, _) = triples
    losses = mlp_steps(
        [(model, optimizer), (reference, ref_optimizer), (exact, exact_optimizer)], steps=3
    )
    assert our_steps == ref_steps == [1, 1, 1]
    assert losses[0::3] == pytest.approx(losses[1::3], rel=1e-5)
    # AdamW divides each update by the gradient's running scale: an element whose gradient is a
    # near-cancelling sum moves by far more than a few ulps under float32 rounding, in torch's
    # own run as in ours (on an AVX-512 host, fc1.weight: ours up to 1.5e-6 from torch's,
    # torch's own up to 1.6e-6 from float64, past an elementwise rtol 1e-5 / atol 1e-6). So
    # ours is held to torch float32's own error against float64.
    assert list(model.state_dict()) == list(reference.state_dict())
    tolerances.assert_params_within_torch_error(
        model.state_dict(),
        reference.state_dict(),
        exact.state_dict(),
        "parameters after three warm-up steps",
    )


def test_forward_hooks_registered_before_initialize_fire_once_per_call():
    """Top-level forward pre-hooks and hooks that change the input and the output, registered
    before `initialize`: applied once per call, as torch does (they were also traced into the
    program, so applied twice), with torch's outputs and gradients."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    calls = {"ours": [], "torch": []}

    def hooks(name):
        def halve_input(module, args):
            calls[name].append("pre")
            return (args[0] * 0.5,)

        def double_output(module, args, output):
            calls[name].append("post")
            return output * 2

        return halve_input, double_output

    for m, name in ((module, "ours"), (reference, "torch")):
        pre, post = hooks(name)
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    model, optimizer = zerojax.initialize(module, optimizer, ZERO3)
    losses = mlp_steps([(model, optimizer), (reference, ref_optimizer)], steps=2)
    assert losses[0::2] == pytest.approx(losses[1::2], rel=1e-5)
    assert calls["ours"] == calls["torch"] == ["pre", "post"] * 2
    assert_same_state(model.state_dict(), reference.state_dict())


# --- nothing named zerojax in what is saved ---------------------------------------------------


def trainer_saved(out, *, zerojax_model: bool):
    """Two Trainer steps of a small Llama (built from a LlamaConfig), then `save_model`: the
    saved directory and the model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    from tests.distributed.hf_trainer_script import Tokens

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )
    )  # fmt: skip
    if zerojax_model:
        model, _ = zerojax.initialize(model, config=ZERO3)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=8, report_to=[],
        use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(16, seed=0))
    trainer.train()
    trainer.save_model(str(out / "final"))
    return out / "final", model


@pytest.mark.long
def test_trainer_save_model_config_is_plain_trainers(tmp_path):
    """`config.json` of a `save_model` directory is byte for byte the plain Trainer's but for
    `_name_or_path` (it was `"architectures": ["ZeroJaxLlamaForCausalLM"]`, which tools that
    pick the class from that field fail on), `model.config` in memory says the same, the saved
    weights have the same names, and the class's name is the model's."""
    their_dir, theirs = trainer_saved(tmp_path / "torch", zerojax_model=False)
    our_dir, ours = trainer_saved(tmp_path / "zerojax", zerojax_model=True)

    def config_text(directory):
        config = json.loads((directory / "config.json").read_text())
        config.pop("_name_or_path", None)
        return config

    assert config_text(our_dir) == config_text(their_dir)
    our_lines = [
        line
        for line in (our_dir / "config.json").read_text().splitlines()
        if '"_name_or_path"' not in line
    ]
    their_lines = [
        line
        for line in (their_dir / "config.json").read_text().splitlines()
        if '"_name_or_path"' not in line
    ]
    assert our_lines == their_lines
    assert ours.config.architectures == theirs.config.architectures == ["LlamaForCausalLM"]
    assert type(ours).__name__ == type(theirs).__name__ == "LlamaForCausalLM"
    assert type(ours).__qualname__ == "LlamaForCausalLM"
    from safetensors import safe_open

    def names(directory):
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert names(our_dir) == names(their_dir)
    assert not any("zerojax" in name.lower() for name in ours.state_dict())


class WithExtraState(MLP):
    """An MLP with extra state (`get_extra_state`), as TransformerEngine's layers keep."""

    def __init__(self):
        super().__init__()
        self.seen = {"batches": 0}

    def get_extra_state(self):
        return dict(self.seen)

    def set_extra_state(self, state):
        self.seen = dict(state)


def test_state_dict_hooks_and_extra_state_as_torch():
    """State-dict hooks registered before `initialize` run once per `state_dict()` and their
    edits (a renamed key) are kept, and extra state is saved and loaded, as in torch. (A
    renaming hook raised KeyError, and so did a module with extra state.)"""
    torch.manual_seed(0)
    module = WithExtraState()
    reference = copy.deepcopy(module)
    fired = {"ours": [], "torch": []}
    for m, name in ((module, "ours"), (reference, "torch")):

        def rename_head(mod, state, prefix, metadata, name=name):
            fired[name].append("post")
            for key in [k for k in state if k.startswith(prefix + "head.")]:
                state[key.replace("head.", "classifier.", 1)] = state.pop(key)

        m.register_state_dict_pre_hook(
            lambda mod, prefix, keep, name=name: fired[name].append("pre")
        )
        m.register_state_dict_post_hook(rename_head)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    model, optimizer = zerojax.initialize(module, optimizer, ZERO3)
    mlp_steps([(model, optimizer), (reference, ref_optimizer)])
    model.seen["batches"] = reference.seen["batches"] = 2
    ours, theirs = model.state_dict(), reference.state_dict()
    assert fired["ours"] == fired["torch"] == ["pre", "post"]
    assert ours["_extra_state"] == theirs["_extra_state"] == {"batches": 2}
    assert "classifier.weight" in ours
    assert_same_state(
        {k: v for k, v in ours.items() if k != "_extra_state"},
        {k: v for k, v in theirs.items() if k != "_extra_state"},
    )
    # Extra state loads back through set_extra_state, into zerojax's model and plain torch's.
    torch.manual_seed(1)
    fresh, plain = WithExtraState(), WithExtraState()
    state = copy.deepcopy(fresh.state_dict())
    state["_extra_state"] = {"batches": 7}
    wrapped, _ = zerojax.initialize(fresh, None, ZERO3)
    wrapped.load_state_dict(state)
    plain.load_state_dict(state)
    assert wrapped.seen == plain.seen == {"batches": 7}
    assert_same_state(
        {k: v for k, v in wrapped.state_dict().items() if k != "_extra_state"},
        {k: v for k, v in plain.state_dict().items() if k != "_extra_state"},
    )


@pytest.mark.long
def test_trainer_with_torch_compile_trains_as_the_plain_trainer(tmp_path):
    """`TrainingArguments(torch_compile=True)` (the Trainer calls `torch.compile(model)`) on a
    zerojax model: plain eager Trainer's losses (1e-5 relative: reordered float32 sums over
    three AdamW steps), and a plain `config.json`."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    from tests.distributed.hf_trainer_script import Tokens

    def train(out, zerojax_model):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )
        )  # fmt: skip
        if zerojax_model:
            model, _ = zerojax.initialize(model, config=ZERO3)
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=3, per_device_train_batch_size=8, logging_steps=1,
            report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
            torch_compile=zerojax_model,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(64, seed=0))
        trainer.train()
        trainer.save_model(str(out / "final"))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, json.loads((out / "final" / "config.json").read_text())

    theirs, their_config = train(tmp_path / "torch", zerojax_model=False)
    ours, our_config = train(tmp_path / "zerojax", zerojax_model=True)
    assert len(ours) == len(theirs) == 3
    assert ours == pytest.approx(theirs, rel=1e-5)
    their_config.pop("_name_or_path", None), our_config.pop("_name_or_path", None)
    assert our_config == their_config
