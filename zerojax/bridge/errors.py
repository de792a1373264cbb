"""Errors the bridge raises, each pointing at the user's code."""

from __future__ import annotations

import re

import torch


class CaptureError(RuntimeError):
    """torch.export could not capture the model; carries torch's own reason."""


class UnsupportedOpError(NotImplementedError):
    """The captured graph contains ATen overloads zerojax has no lowering for."""


class MissingLoweringError(UnsupportedOpError):
    """The graph uses ATen overloads with no lowering; `.ops` names them."""

    def __init__(self, message: str, ops: tuple[str, ...]):
        super().__init__(message)
        self.ops = ops


class DataDependentShapeError(UnsupportedOpError):
    """An op's output shape depends on tensor values (nonzero, masked_select); JAX needs static
    shapes."""


def node_location(node: torch.fx.Node) -> str:
    """'module path (ModuleType) at file:line' for a graph node, from export's metadata."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, module_type = list(stack.values())[-1]
        module_name = getattr(module_type, "__name__", None) or str(module_type).rsplit(".", 1)[-1]
        where = f"module '{path or '<root>'}' ({module_name})"
    else:
        where = "module '<root>'"
    source = user_source_line(node)
    return f"{where} at {source}" if source else where


def user_source_line(node: torch.fx.Node) -> str | None:
    """The innermost 'file:line  code' of the user's frame that produced this node."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    user_frames = [f for f in frames if "/torch/" not in f[0]]
    if not user_frames:
        user_frames = frames
    if not user_frames:
        return None
    path, line, code = user_frames[-1]
    return f"{path}:{line}  `{code.strip()}`"
