"""`dflash_train.training.data`: the loader thread that prepares step n+1 while step n runs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflash_train.training.data import step_loader


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread's pool has one thread")
def test_the_step_loader_runs_its_tensor_ops_on_one_thread_of_its_own() -> None:
    """Its ops are small, and on torch's shared pool each one waits for every pool thread (milliseconds when
    the training thread holds a core). The training thread keeps its own pool size."""
    suite = torch.get_num_threads()  # the suite runs on one thread (conftest): give the training thread two
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(1) as plain:  # the control: a thread without the setting gets the same pool
            assert plain.submit(torch.get_num_threads).result() == 2
        with step_loader() as loader:
            assert loader.submit(torch.get_num_threads).result() == 1
            x = torch.arange(100_000)
            assert torch.equal(loader.submit(lambda: (x * 3).clamp(max=5)).result(), (x * 3).clamp(max=5))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(suite)
