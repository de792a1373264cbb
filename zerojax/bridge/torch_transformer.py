"""torch's own transformer modules (`nn.TransformerEncoder`, `nn.TransformerDecoder`,
`nn.Transformer`), made capturable with the attention masks users pass.

**Causal-mask detection.** When no `is_causal` hint is given, `TransformerEncoder.forward` and
`TransformerDecoder.forward` call `torch.nn.modules.transformer._detect_is_causal_mask`, which
compares the mask with a generated causal mask and calls `bool()` on the result: a read of a
tensor's values on the host. torch.export cannot trace it (`GuardOnDataDependentSymNode`), so
pytorch/examples' word_language_model and every encoder or decoder given a square causal mask
(`nn.Transformer.generate_square_subsequent_mask`) failed to capture. While capturing, the
detection decides from the hint alone, as torch does when a hint is given: `is_causal is True`.

Numerically this is torch's result either way. torch's detection only returns True for a mask
equal to the generated causal mask; the layers then either keep applying that mask (a key
padding mask or attention weights are asked for: `F.multi_head_attention_forward` merges the
masks and turns the hint off) or drop it and pass `is_causal=True` to
`scaled_dot_product_attention`, which masks the same positions with -inf. Adding the mask's
zeros and -infs to the scores masks exactly those positions too, so the softmax, and every
output and gradient, are those of the causal path (up to the order of float operations inside
the attention kernel). A mask that is not causal was never dropped and still is not.

**Fast paths.** In eval mode without gradients torch's modules take native fast paths
(`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`, and in
`TransformerEncoder` with `enable_nested_tensor=True` and a `src_key_padding_mask`, nested
tensors, which torch.export cannot hold). Whether torch.export reaches them depends on torch's
checks of tracing state (make_fx tracing, forward hooks, `mask_check` under torch.export) and on
the grad mode at the time of capture, while zerojax's program for eval mode serves calls with
and without gradients. So while capturing, torch's own switch for them,
`torch.backends.mha.set_fastpath_enabled(False)`, is off, and every capture records the general
path, with the values of the fast paths and one exception torch.compile shares (its tracing
refuses the nested path too, with the default `mask_check=True`): the nested path returns 0 at
padded positions (before the encoder's final norm), the general path the values computed there,
which are also what eager torch returns with gradients enabled. At every position that is not
padding the values are the same.

Not done: recovering a given mask's causal pattern. The program applies the mask as it is, not
as `is_causal`, so the attention kernel does not skip the masked blocks; the mask is often a
value the program cannot know (an input, a buffer), and torch's own hint (`is_causal=True`)
keeps its meaning.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.modules.transformer as torch_transformer

__all__ = ["transformer_modules_traceable"]


def _is_causal_from_hint(mask, is_causal=None, size=None) -> bool:
    """`_detect_is_causal_mask` without reading the mask's values (module docstring)."""
    del mask, size
    return is_causal is True


@contextlib.contextmanager
def transformer_modules_traceable():
    """Within: torch's transformer modules take `is_causal` from the caller's hint alone, and
    take their general path, never a native fast path (module docstring). Both are put back on
    exit."""
    detect = getattr(torch_transformer, "_detect_is_causal_mask", None)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    if detect is not None:
        torch_transformer._detect_is_causal_mask = _is_causal_from_hint
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        if detect is not None:
            torch_transformer._detect_is_causal_mask = detect
