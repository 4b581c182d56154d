"""What every benchmark records beside its figures: the commit it ran (and whether the files differ from it),
and whether torch.compile gave up reading one of the project's Triton kernels (which copies its tensors)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.common import git_commit, kernel_analysis_fallbacks
from dflash_train.kernels import skinny_matmul
from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.skinny_matmul import Config, _skinny_matmul_kernel
from tests.helpers.kernels import pointers_written


def test_a_copy_whose_files_differ_from_its_commit_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_TRAIN_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "a"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "untracked.txt").write_text("not part of the code")
    assert git_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit() == f"{head}+modified"
    monkeypatch.setenv("DFLASH_TRAIN_COMMIT", "abc1234")
    assert git_commit() == "abc1234"


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_a_kernel_the_compiler_cannot_read_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's own analysis, given the skinny kernel as a dependent launch (inline assembly with side
    effects), gives up with its warning, which the benchmarks count; the plain launch passes unnoticed."""
    bf16 = dict(dtype=torch.bfloat16)
    kwargs = dict(x_ptr=torch.empty(16, 256, **bf16), g_ptr=torch.empty(256, **bf16), w_ptr=torch.empty(64, 256, **bf16),
                  b_ptr=torch.empty(64, **bf16), r_ptr=torch.empty(16, 64, **bf16), y_ptr=torch.empty(16, 64, **bf16),
                  p_ptr=torch.empty(16, 64, **bf16), s_in_ptr=torch.empty(16, 8), s_out_ptr=torch.empty(16, 2), M=16,
                  N=64, K=256, K_SPLIT=256, P_IN=8, P_OUT=2, stride_xm=256, stride_wn=256, stride_rm=64, stride_ym=64)
    flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=False)
    with kernel_analysis_fallbacks() as fallbacks:
        plain = skinny_matmul.kernel_constants(torch.bfloat16, 256, 0.0, flags, Config(32, 128))
        pointers_written(_skinny_matmul_kernel, {**kwargs, **plain}, monkeypatch)
        assert fallbacks == []
        pdl = skinny_matmul.kernel_constants(torch.bfloat16, 256, 0.0, flags, Config(32, 128), pdl=True)
        pointers_written(_skinny_matmul_kernel, {**kwargs, **pdl}, monkeypatch)
    assert len(fallbacks) == 1
