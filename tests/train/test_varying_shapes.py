"""Varying input shapes: one torch.export capture serves many shapes, opt-in bucketing pads to
a few, and a warning says when shapes keep changing (issue 43, part 4).

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/train/test_varying_shapes.py
Why: the Hugging Face Trainer's default collators pad each batch to its longest row, so a
fine-tune sees a new sequence length almost every step, and each one re-ran torch.export and
XLA (15 lengths in 20 steps: 15 captures). Now the second shape is captured with the changed
dims symbolic and that capture serves every later shape its guards admit
(`zerojax.bridge.symbolic_shapes`); `inputs.pad_to_multiple_of` pads calls of `input_ids`,
`attention_mask` and `labels` up to buckets (`zerojax.train.shape_buckets`). Plain torch on
the same inputs is the reference throughout; captures are counted as calls of
`torch.export.export`, compilations as JAX's backend-compile events.
"""

from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src import dispatch

import zerojax
from tests import tolerances

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (a dev dependency)")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 64
CONFIG: dict = {}  # the default mesh: every (simulated) device on the data axis


@pytest.fixture
def exports(monkeypatch):
    """Counts calls of torch.export.export (whoever makes them)."""
    count = {"n": 0}
    real = torch.export.export

    def counted(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return count


class Compiles:
    """JAX backend compilations (XLA), counted while listening, with the name of each compiled
    function (`jit(fused)`: the fused step program, `jit(program)`: a recorded eager program,
    `jit(convert_element_type)`: a cast, ...)."""

    def __init__(self):
        self.names: list[str] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    @property
    def count(self) -> int:
        return len(self.names)

    def _on_event(self, event, secs, fun_name="?", **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            self.names.append(fun_name)

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


# --- the bridge: symbolic captures and their guards ------------------------------------------


class Branchy(torch.nn.Module):
    """Python branches on the sequence length: a capture is right only for lengths on the same
    side of each branch (the guards torch records), and `view` and `arange` read the length."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, tokens):
        x = self.embed(tokens)
        if x.shape[1] > 16:
            x = x * 2
        if x.shape[1] % 4 == 0:
            x = x + torch.arange(x.shape[1], dtype=x.dtype)[:, None]
        # Every feature out (no sum): a few thousand elements, whose error norms concentrate.
        return self.proj(x).view(x.shape[0], -1)


def test_symbolic_capture_serves_lengths_its_guards_admit(exports):
    """Lengths on each side of both branches match torch; a capture is reused only where the
    guards torch recorded hold (without them 11 would reuse the capture of 25, 24 that of 25
    and the outputs be wrong by O(10-100)), and sizes 0/1-specialised by torch capture anew."""
    model = Branchy().eval()
    twin = copy.deepcopy(model).double()
    first = torch.randint(0, VOCAB, (2, 20))
    converted = zerojax.convert(model, (), {"tokens": first})
    # (length, torch.export calls after it): 25 and 21 share the symbolic capture made at 25
    # (> 16, not a multiple of 4); 12, 11 and 24 each fall on another side of a branch; 40 and
    # 44 reuse the one made at 24; 1 is torch's size-1 specialisation, 3 reuses 11's.
    expected = [(20, 1), (25, 2), (21, 2), (12, 3), (11, 4), (24, 5), (40, 5), (44, 5), (1, 6)]
    expected += [(3, 6), (9, 6)]
    for length, count in expected:
        tokens = torch.randint(0, VOCAB, (2, length))
        out, _ = converted.apply(converted.params, converted.buffers, tokens=jnp.asarray(tokens))
        assert exports["n"] == count, length
        with torch.no_grad():
            tolerances.assert_within_torch_error(
                torch.tensor(np.asarray(out)), model(tokens), twin(tokens), f"length {length}"
            )


def test_a_changing_batch_size_is_captured_symbolic_too(exports):
    """A short last batch, an eval batch of another size: the batch dim changes and the second
    size's capture serves the others (a new length after that captures once more, with both
    dims symbolic, then serves every (batch, length))."""
    model = Branchy().eval()
    twin = copy.deepcopy(model).double()
    converted = zerojax.convert(model, (), {"tokens": torch.zeros(4, 20, dtype=int)})
    expected = [(4, 20, 1), (6, 20, 2), (3, 20, 2), (10, 20, 2), (5, 24, 3), (7, 28, 3)]
    expected += [(2, 36, 3)]
    for rows, length, count in expected:
        tokens = torch.randint(0, VOCAB, (rows, length))
        out, _ = converted.apply(converted.params, converted.buffers, tokens=jnp.asarray(tokens))
        assert exports["n"] == count, (rows, length)
        with torch.no_grad():
            tolerances.assert_within_torch_error(
                torch.tensor(np.asarray(out)), model(tokens), twin(tokens), f"{rows}x{length}"
            )


def test_output_shapes_of_a_symbolic_capture_are_the_call_s():
    """`Converted.output_shapes` (what the fused training path reads the loss off) gives each
    call's own sizes from a symbolic capture, not the sizes it was traced with."""
    converted = zerojax.convert(Branchy().eval(), (), {"tokens": torch.zeros(2, 20, dtype=int)})
    for length in (25, 21, 33):
        shapes = converted.output_shapes(tokens=jnp.zeros((3, length), jnp.int32))
        assert shapes.shape == (3, length * 8)
    assert len(converted._symbolic) == 1  # one structure, served symbolically


def test_many_shapes_warn_once_naming_the_changing_dim(caplog):
    """After MANY_SHAPES distinct shapes one warning names the input and dim that keep changing
    and both fixes; it does not repeat."""
    from zerojax.bridge.convert import MANY_SHAPES

    converted = zerojax.convert(Branchy().eval(), (), {"tokens": torch.zeros(2, 21, dtype=int)})
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        for length in range(22, 22 + 2 * MANY_SHAPES):
            converted.output_shapes(tokens=jnp.zeros((2, length), jnp.int32))
    many = [r.getMessage() for r in caplog.records if "distinct input shapes" in r.getMessage()]
    assert len(many) == 1, many
    assert f"{MANY_SHAPES} distinct input shapes" in many[0]
    assert "'tokens' dim 1" in many[0]
    assert "pad_to_multiple_of" in many[0] and "inputs.pad_to_multiple_of" in many[0]


# --- the Trainer with dynamic padding ----------------------------------------------------------


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tokenizer():
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[PAD]")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), pad_token="[PAD]", padding_side="right"
    )


# The Trainer's seeded sampler draws these rows in pairs whose padded lengths are 12, 29, 17,
# 13, 23, 30: a new length every step (asserted below), in two buckets of 16 (16 and 32).
LENGTHS = [5, 9, 13, 23, 17, 29, 30, 11, 12, 19, 7, 22]
STEPS = 6


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.rows = []
        for length in LENGTHS:
            ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
            self.rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def fine_tune(tmp_path, config=None, *, zerojax_model=True):
    """STEPS Trainer steps with dynamic padding (DataCollatorForSeq2Seq: pad to the longest row,
    labels -100); the Trainer's own AdamW and schedule. Returns (logged (loss, grad_norm) per
    step, padded batch shapes, the names of the backend compilations of each step, the
    model)."""
    torch.manual_seed(0)
    model = llama()
    if zerojax_model:
        model, _ = zerojax.initialize(model, config=config or CONFIG)
    shapes: list[tuple] = []
    collator = transformers.DataCollatorForSeq2Seq(tokenizer(), padding="longest")

    def collate(features):
        batch = collator(features)
        shapes.append(tuple(batch["input_ids"].shape))
        return batch

    logs: list[tuple[float, float]] = []
    per_step: list[list[str]] = []
    compiles = Compiles()

    class Recorder(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.start = compiles.count

        def on_step_end(self, *args, **kwargs):
            per_step.append(compiles.names[self.start :])

    class Logged(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append((logs["loss"], logs["grad_norm"]))

    logged = logs
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2,
        logging_steps=1, learning_rate=1e-3, max_grad_norm=1.0, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Rows(),
        data_collator=collate,
        callbacks=[Recorder(), Logged()],
    )
    try:
        trainer.train()
    finally:
        compiles.close()
    return logs, shapes, per_step, model


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    return fine_tune(tmp_path_factory.mktemp("torch"), zerojax_model=False)


@pytest.fixture(scope="module")
def zerojax_run(tmp_path_factory):
    """The unbucketed zerojax fine-tune, and the number of torch.export calls it made."""
    calls = {"n": 0}
    real = torch.export.export

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    torch.export.export = counted
    try:
        run = fine_tune(tmp_path_factory.mktemp("zerojax"))
    finally:
        torch.export.export = real
    return run, calls["n"]


@pytest.fixture(scope="module")
def bucketed_run(tmp_path_factory):
    """The zerojax fine-tune with inputs.pad_to_multiple_of {sequence: 16}."""
    config = {**CONFIG, "inputs": {"pad_to_multiple_of": {"sequence": 16}}}
    return fine_tune(tmp_path_factory.mktemp("bucketed"), config)


# What a fine-tune compiles whatever its input shapes: the Trainer's clip as a recorded program
# (`jit(program)`), and its AdamW, adopted as the engine's compiled update
# (`zerojax.train.late_optimizers`): the state made once (`jit(initial_state)`) and the update
# (`jit(call)`, through the program cache); all take parameters and gradients, never the batch.
# The first step also makes a constant once per process (`jit(convert_element_type)` of a 0-d
# float32: the loss scale 1.0 without fp16).
OPTIMIZER_PROGRAMS = ("jit(program)", "jit(initial_state)", "jit(call)")
FIRST_STEP_CONSTANT = "jit(convert_element_type)"


def step_programs(step: int, names: list[str]) -> list[str]:
    """The compilations of a step that depend on its input shapes."""
    names = [n for n in names if n not in OPTIMIZER_PROGRAMS]
    if step == 0 and FIRST_STEP_CONSTANT in names:
        names.remove(FIRST_STEP_CONSTANT)
    return names


@pytest.mark.long
def test_trainer_with_dynamic_padding_captures_once_more_and_matches_torch(torch_run, zerojax_run):
    """6 distinct lengths in 6 steps: the first capture, then one symbolic capture serving the
    other 5 (it was 6 captures), and one XLA compilation per length: its fused step program.
    Logged losses and gradient norms equal plain torch's to 1e-5 relative (float32, reordered
    sums: ~1e-7 a step, as in test_hf_trainer)."""
    theirs, their_shapes, _, _ = torch_run
    (ours, our_shapes, per_step, _), num_exports = zerojax_run
    for step, names in enumerate(per_step):
        assert step_programs(step, names) == ["jit(fused)"], (step, names)
    assert our_shapes == their_shapes and len(set(our_shapes[:STEPS])) == 6, our_shapes
    # torch 2.14's export of HF Llama with a symbolic sequence length fails (its own error,
    # logged at debug level): zerojax then captures each length as it is, with the same
    # numbers; torch 2.11-2.13 export it symbolically. Known limitation, not a pass condition.
    torch_version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert num_exports == (2 if torch_version < (2, 14) else 1 + 6)
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)


@pytest.mark.long
def test_bucketed_trainer_matches_unbucketed_and_compiles_once_per_bucket(
    torch_run, zerojax_run, bucketed_run
):
    """inputs.pad_to_multiple_of {sequence: 16}: the 6 lengths fall in 2 buckets (16, 32); the
    losses and gradient norms are the unbucketed run's (padding masked and labelled -100: the
    same sums, over a longer, zero-padded reduction: 1e-5 relative) and a step whose bucket was
    seen before compiles nothing."""
    (unbucketed, shapes, _, _), _ = zerojax_run
    theirs = torch_run[0]
    ours, _, per_step, model = bucketed_run
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(unbucketed), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    buckets = [-(-length // 16) * 16 for _, length in shapes[:STEPS]]
    assert len(set(buckets)) == 2
    seen = set()
    for step, bucket in enumerate(buckets):
        if bucket in seen:
            assert not per_step[step], (step, bucket, per_step)
        seen.add(bucket)
    programs = model._zerojax_engine._converted[True]._programs
    assert {key[1][0][0][1] for key in programs} == set(buckets)


@pytest.mark.long
def test_bucketed_trainer_compiles_one_step_program_per_bucket(zerojax_run, bucketed_run):
    """The compilations themselves, by name: each bucket compiles its fused step program
    (forward, backward and the model's loss in one) and nothing else; what the run compiles
    besides does not depend on the batch (the optimizer's programs, the first step's
    constant), at most 3 programs in all. The inputs' int64 -> int32 cast used to be a compiled
    program of its own for every new shape (`jnp.array(..., dtype=int32)`: a
    `jit(convert_element_type)` per bucket); it is numpy's now, on the host
    (`zerojax.bridge.dtypes.host_array`)."""
    (_, shapes, _, _), _ = zerojax_run
    _, _, per_step, _ = bucketed_run
    buckets = [-(-length // 16) * 16 for _, length in shapes[:STEPS]]
    firsts = {buckets.index(bucket) for bucket in set(buckets)}
    for step, names in enumerate(per_step):
        expected = ["jit(fused)"] if step in firsts else []
        assert step_programs(step, names) == expected, (step, names)
        if step > 1:  # the optimizer's programs are compiled by the first two steps
            assert names == expected, (step, names)
    others = [n for names in per_step for n in names if n != "jit(fused)"]
    assert len(others) <= 3, others


# --- bucketing: outputs, loss and gradients equal the unpadded call's ------------------------


def _batch(rows: int, length: int):
    generator = torch.Generator().manual_seed(rows * 100 + length)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, length - 3 :] = 0  # a right-padded row, as the collator makes
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("multiples", [{"sequence": 16}, {"sequence": 16, "batch": 4}])
def test_bucketed_call_gives_the_unpadded_outputs_loss_and_gradients(multiples):
    """A call padded to (4, 32) from (3, 21): logits sliced back to (3, 21, V) equal torch's,
    the loss equals torch's unpadded loss, and the gradients of a loss computed from the
    logits (general path) and of the model's own loss (fused path) equal torch's, within
    torch's own float32 error against float64 (tolerances.assert_within_torch_error)."""
    torch.manual_seed(0)
    reference = llama()
    twin = copy.deepcopy(reference).double()
    model, _ = zerojax.initialize(
        copy.deepcopy(reference), config={**CONFIG, "inputs": {"pad_to_multiple_of": multiples}}
    )
    batch = _batch(3, 21)
    out = model(**batch)
    assert out.logits.shape == (3, 21, VOCAB)
    expected, exact = reference(**batch), twin(**batch)
    tolerances.assert_within_torch_error(
        out.logits.detach(), expected.logits.detach(), exact.logits.detach(), "logits"
    )
    tolerances.assert_within_torch_error(
        out.loss.detach().reshape(1), expected.loss.detach().reshape(1),
        exact.loss.detach().reshape(1), "loss", floor=tolerances.ulps(torch.float32, 8),
    )  # fmt: skip
    # The model's own loss (fused program) and a loss of the sliced logits (general program).
    out.loss.backward()
    expected.loss.backward()
    exact.loss.backward()
    _assert_grads(model, reference, twin, "own loss")
    model.zero_grad(), reference.zero_grad(), twin.zero_grad()
    batch = _batch(3, 19)
    for m in (model, reference, twin):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   labels=batch["labels"]).logits  # fmt: skip
        (logits.float().square().mean() if m is not twin else logits.square().mean()).backward()
    _assert_grads(model, reference, twin, "loss of the logits")


def _assert_grads(model, reference, twin, what):
    names = [n for n, _ in reference.named_parameters()]
    ours = dict(model.named_parameters())
    got = {n: ours[n].grad.detach().double().numpy() for n in names}
    low = {n: p.grad.double().numpy() for n, p in reference.named_parameters()}
    exact = {n: p.grad.numpy() for n, p in twin.named_parameters()}
    tolerances.assert_params_within_torch_error(got, low, exact, what)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: ((b["input_ids"],), {"labels": b["labels"]}), "positionally"),
        (lambda b: ((), {"input_ids": b["input_ids"], "labels": b["labels"]}), "attention_mask"),
        (
            lambda b: ((), {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}),
            "no labels",
        ),
        (
            lambda b: ((), {**b, "position_ids": torch.arange(21)[None].expand(3, 21)}),
            "'position_ids'",
        ),
    ],
    ids=["positional", "no-mask", "no-labels", "other-input"],
)
def test_bucketing_refuses_what_it_cannot_prove_neutral(call, message):
    model, _ = zerojax.initialize(llama(), config={**CONFIG, "inputs": {"pad_to_multiple_of": 16}})
    args, kwargs = call(_batch(3, 21))
    with pytest.raises(ValueError, match=message):
        model(*args, **kwargs)


def test_batch_bucketing_refuses_batch_norm():
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 8)
            self.norm = torch.nn.BatchNorm1d(8)

        def forward(self, input_ids, attention_mask, labels):
            return self.norm(self.embed(input_ids).transpose(1, 2)).sum()

    model, _ = zerojax.initialize(
        Tagger(), config={**CONFIG, "inputs": {"pad_to_multiple_of": {"batch": 4}}}
    )
    with pytest.raises(ValueError, match="BatchNorm.*'norm'"):
        model(**_batch(3, 21))
