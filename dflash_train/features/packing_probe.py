"""Whether a packed pass keeps chats apart: each attention layer's output on a packed row against its output on
each chat alone, every layer fed the very inputs it had alone.

Why teacher-forced: the layers' outputs compared end to end drift apart by rounding alone in a 16-bit target,
and a mixture of experts turns a last-place difference into another expert for that token, so a deep bf16
MoE fails an end-to-end comparison whose packed attention is exact (docs/training.md, 'Packed rows', has the
figures). Fed the inputs each chat had alone, a layer's attention differs by its own rounding only, while an
attention that lets a chat see another, or ignores a layer's window, is far off at that layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def attention_modules(decoder_layers: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """The softmax-attention module of each decoder layer that has one (`self_attn`), by layer index."""
    return {index: layer.self_attn for index, layer in enumerate(decoder_layers)
            if isinstance(getattr(layer, "self_attn", None), nn.Module)}


@contextmanager
def recorded(modules: dict[int, nn.Module], inputs: dict[int, list[torch.Tensor]],
             outputs: dict[int, list[torch.Tensor]], replace: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Record each module's hidden-states input and output per call; with `replace`, feed it that input instead."""
    handles = []
    for index, module in modules.items():
        handles.append(module.register_forward_pre_hook(_pre_hook(index, inputs, replace), with_kwargs=True))
        handles.append(module.register_forward_hook(_hook(index, outputs)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _pre_hook(index: int, inputs: dict[int, list[torch.Tensor]],
              replace: dict[int, torch.Tensor] | None) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if replace is not None and index in replace:
            hidden = replace[index].to(hidden.dtype)
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": hidden}
            else:
                args = (hidden, *args[1:])
        inputs.setdefault(index, []).append(hidden.detach())
        return args, kwargs

    return hook


def _hook(index: int, outputs: dict[int, list[torch.Tensor]]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        outputs.setdefault(index, []).append((output[0] if isinstance(output, tuple) else output).detach())

    return hook


def relative_errors(packed: dict[int, list[torch.Tensor]], alone: dict[int, list[torch.Tensor]]) -> dict[int, float]:
    """Per layer: ||packed − the chats' outputs side by side|| / ||the chats' outputs||, fp32."""
    errors = {}
    for index, (row,) in packed.items():
        expected = torch.cat(alone[index], dim=1).float()
        errors[index] = float((row.float() - expected).norm() / expected.norm().clamp_min(1e-12))
    return errors
