"""torch.compile for fixed shapes, with room for every variant a run meets.

One compiled code serves every decoder layer (the decode cycle's compile scope "layer", the training target's
compiled layers), so each distinct variant of it traces a graph of its own: a layer kind (DeepSeek-V3's dense
first layers beside its experts, a hybrid's two kinds), a step's token count (decode, verify, the drafter's
context), a batch size, a padded length. Dynamo keeps 8 graphs a code by default and runs the code uncompiled
for whatever comes after, with one warning: a process that decodes at two batch sizes, or a benchmark that
measures several paths, would time some of them eager. The variants are bounded by design, so the limit is
raised to a bound they stay far under.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config

RECOMPILE_LIMIT = 64


def compile_fixed_shapes(fn: Callable[..., Any], options: tuple[tuple[str, Any], ...] = ()) -> Callable[..., Any]:
    """`fn` compiled for static shapes (each new shape its own graph), with inductor `options`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False, options=dict(options) or None)
