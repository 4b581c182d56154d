"""The decode engine's cycle made ready to run fast: warmed up (the Triton kernels and, where enabled, the
torch.compile graphs compiled), compiled again without the split-key attention kernel or run uncompiled where
the compiler fails, then captured once as a CUDA graph that each `step` replays (eager cycles off CUDA or
where capture fails).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class CycleGraphMixin:
    """The DecodeEngine's warm-up, compile fallback and CUDA graph. Relies on the engine's `device`, `config`,
    `runner`, `drafter`, `state`, `_cycle`, `_compile`, `_graph`, `_prepared`, `graph_error` and
    `compile_error`."""

    @property
    def uses_cuda_graph(self) -> bool:
        return self._graph is not None

    @property
    def uses_compile(self) -> bool:
        return self._compile

    @torch.no_grad()
    def prepare(self) -> None:
        """Warm up (compiles the Triton kernels and, if enabled, the torch.compile graphs) and, on CUDA,
        capture the cycle as a graph. Call before any request is in flight; `run` calls it once."""
        self._prepared = True
        self.state.done.fill_(True)  # idle rows: the warm-up cycles change no state
        try:
            self._warm_up()
        except Exception as error:  # a compiler failure costs speed, not the run
            if not self._compile:
                raise
            self.compile_error = f"{type(error).__name__}: {error}"
            self._recover_from_compile_error()
        if self.device.type == "cuda" and self.config.cuda_graphs and getattr(self.runner, "graphable", True):
            self._capture()

    def _recover_from_compile_error(self) -> None:
        """Retry compiled with SDPA in place of the split-key attention kernel, then uncompiled."""
        if self.runner.kernels == "triton":
            logger.warning("torch.compile failed (%s); retrying with SDPA attention", self.compile_error)
            self.runner.kernels = "torch"
            if self.drafter is not None:
                self.drafter.use_sdpa_attention()
            try:
                self._warm_up()
                return
            except Exception as error:
                self.compile_error += f"; with SDPA attention: {type(error).__name__}: {error}"
        logger.warning("torch.compile failed (%s); running the cycle uncompiled", self.compile_error)
        self._compile = False
        self._warm_up()

    def _warm_up(self) -> None:
        if self.device.type != "cuda":
            for _ in range(2 if self._compile else 1):
                self._cycle()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._cycle()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._cycle()
            self._graph = graph
        except Exception as error:  # fall back to eager cycles rather than fail the run
            self.graph_error = f"{type(error).__name__}: {error}"
            logger.warning("CUDA graph capture failed (%s); running eager cycles", self.graph_error)
            torch.cuda.synchronize()

    @torch.no_grad()
    def step(self) -> None:
        """One cycle for every row (a graph replay on CUDA); rows that are done stay unchanged."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self._cycle()
