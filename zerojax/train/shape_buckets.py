"""Opt-in bucketing of varying input shapes (config `inputs.pad_to_multiple_of`).

Batches padded to their longest row (the Hugging Face Trainer's default collators) have a new
length almost every step, and every new shape is a new XLA program (a symbolic capture spares
torch.export, not XLA: `bridge.symbolic_shapes`). With `inputs.pad_to_multiple_of:
{sequence: 64}` each call's inputs are padded further, up to the next multiple, so a run
compiles at most one step program per bucket (the fused forward and backward of a model that
computes its loss, as under the Trainer; a loss computed from the outputs takes a forward and
a backward program); `batch:` does the same for the batch dim (a short last batch, an eval
batch of another size). Nothing else is compiled per shape: inputs reach the program cast on
the host (`zerojax.bridge.dtypes.host_array`), padded and sliced back by torch ops.

Padding must not change what the user gets, and zerojax pads only where that is certain: a
call of keyword inputs `input_ids`, `attention_mask` and `labels` (2-d, one shape), and
nothing else with a batch or sequence dim. The padded positions are masked (attention_mask 0),
so no real position attends to them, and labelled -100, which the loss of every Hugging Face
model ignores (its mean is over the other labels, or divided by the Trainer's
`num_items_in_batch`, counted before padding): the loss is the unpadded loss. Padded rows are
rows of one masked-in pad token with labels -100 (a row with no position to attend to would
make NaN in torch's softmax, and 0 * NaN in the backward pass); they add nothing to the loss
or the gradients as long as rows do not interact, so batch padding is refused for a model with
BatchNorm. Outputs are sliced back to the true shape: dims 0 and 1 of every tensor output
(logits, hidden states; dims 2 and 3 of `attentions`), through torch ops, so a loss the user
computes from the logits gets zero gradients for the padding. A KV cache is left as it is.
Anything else is refused with a `ValueError` that says why, rather than padded on a guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

LABEL_PAD = -100  # torch's cross_entropy ignore_index, the Hugging Face loss's
PADDED_INPUTS = ("input_ids", "attention_mask", "labels")


@dataclasses.dataclass(frozen=True)
class Padding:
    """One call's padded inputs, and how to slice its outputs back (`unpad`)."""

    kwargs: dict[str, Any]
    batch: tuple[int, int]  # (true, padded)
    sequence: tuple[int, int]

    def unpad(self, outputs):
        """`outputs` with every tensor's padded batch and sequence positions sliced off."""
        return _sliced(outputs, self, field=None)


def padding_for(
    module: torch.nn.Module, multiples: Mapping[str, int], args: tuple, kwargs: dict
) -> Padding | None:
    """The padded call for `inputs.pad_to_multiple_of = multiples`, None where the inputs
    already fit their buckets; ValueError where padding is not provably neutral (module
    docstring)."""
    name = type(module).__name__
    where = f"inputs.pad_to_multiple_of {dict(multiples)} ({name})"
    if any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves(args)):
        raise ValueError(
            f"{where}: the call passes tensors positionally; padding is only done for keyword "
            f"inputs {', '.join(PADDED_INPUTS)} (whose padding zerojax knows to be neutral). "
            "Call the model with keywords, or remove inputs.pad_to_multiple_of"
        )
    missing = [key for key in ("attention_mask", "labels") if kwargs.get(key) is None]
    if missing or kwargs.get("input_ids") is None:
        raise ValueError(
            f"{where}: the call has no {' or '.join(missing or ['input_ids'])}; padding is "
            "neutral only where attention_mask masks the padded positions (0) and labels mark "
            "them ignored (-100), so a call without them is not padded. Pass them, pad in the "
            "data collator (pad_to_multiple_of=), or remove inputs.pad_to_multiple_of"
        )
    others = [
        key
        for key, value in kwargs.items()
        if key not in PADDED_INPUTS
        and any(isinstance(leaf, torch.Tensor) and leaf.ndim > 0 for leaf in _leaves(value))
    ]
    if others:
        raise ValueError(
            f"{where}: the call also passes {', '.join(repr(k) for k in others)}, whose padding "
            f"zerojax cannot prove neutral (it pads only {', '.join(PADDED_INPUTS)}); pad in "
            "the data collator (pad_to_multiple_of=) instead, or remove "
            "inputs.pad_to_multiple_of"
        )
    shapes = {key: tuple(kwargs[key].shape) for key in PADDED_INPUTS}
    if len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
        raise ValueError(
            f"{where}: expected input_ids, attention_mask and labels of one (batch, sequence) "
            f"shape, got {shapes}"
        )
    rows, length = shapes["input_ids"]
    padded_rows = _round_up(rows, multiples.get("batch", 1))
    padded_length = _round_up(length, multiples.get("sequence", 1))
    if (padded_rows, padded_length) == (rows, length):
        return None
    if padded_rows != rows:
        batch_norms = [
            path
            for path, m in module.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        ]
        if batch_norms:
            raise ValueError(
                f"{where}: padding the batch is not neutral for a model with BatchNorm "
                f"({batch_norms[0]!r}): padded rows would enter its batch statistics. Use "
                "{sequence: n} alone"
            )
    pad_token = getattr(getattr(module, "config", None), "pad_token_id", None)
    fill = {"input_ids": 0 if pad_token is None else int(pad_token), "attention_mask": 0}
    fill["labels"] = LABEL_PAD
    padded = dict(kwargs)
    for key in PADDED_INPUTS:
        value = kwargs[key]
        out = value.new_full((padded_rows, padded_length), fill[key])
        out[:rows, :length] = value
        if key == "attention_mask":
            out[rows:, 0] = 1  # a padded row attends to its one pad token: no empty softmax
        padded[key] = out
    return Padding(padded, (rows, padded_rows), (length, padded_length))


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _leaves(value) -> list:
    return torch.utils._pytree.tree_leaves(value)


def _sliced(value, padding: Padding, field: str | None):
    if isinstance(value, torch.Tensor):
        return _slice_tensor(value, padding, field)
    if isinstance(value, Mapping):  # a ModelOutput is an ordered dict of its fields
        items = {
            k: v if k == "past_key_values" else _sliced(v, padding, k) for k, v in value.items()
        }
        if hasattr(value, "__dataclass_fields__") or type(value) is not dict:
            for key, item in items.items():
                value[key] = item  # a ModelOutput keeps its class and attribute access
            return value
        return items
    if isinstance(value, (tuple, list)):
        return type(value)(_sliced(v, padding, field) for v in value)
    return value


def _slice_tensor(tensor: torch.Tensor, padding: Padding, field: str | None) -> torch.Tensor:
    (rows, padded_rows), (length, padded_length) = padding.batch, padding.sequence
    if tensor.ndim == 0:
        return tensor
    index: list[slice] = [slice(None)] * tensor.ndim
    if tensor.shape[0] == padded_rows:
        index[0] = slice(0, rows)
    # attentions: (batch, heads, query, key); every other output: (batch, sequence, ...).
    sequence_dims = (2, 3) if field == "attentions" else (1,)
    for dim in sequence_dims:
        if dim < tensor.ndim and tensor.shape[dim] == padded_length:
            index[dim] = slice(0, length)
    if all(s == slice(None) for s in index):
        return tensor
    return tensor[tuple(index)]
