"""The console script: subcommands run through `main()`, user errors are one line with exit code 2."""

from __future__ import annotations

import pathlib

import pytest

from dflash_train.cli import main
from tests.helpers.tiny_models import make_tiny_target


def test_inspect_prints_layer_ids_and_mask_token(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target("qwen3", num_layers=12)
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    assert main(["inspect", "--target", str(tmp_path), "--num-draft-layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "12 / 64 / 320" in out
    assert "[1, 5, 9]" in out  # round(1 + i * 8 / 2)
    # 256 tokens in a 320-row table: the first unused row is the mask token
    assert "256" in out and "unused_embedding_row" in out


def test_bad_target_is_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    assert main(["inspect", "--target", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train inspect: error:") and "\n" not in err


@pytest.mark.parametrize(("requested", "local_rank", "expected"),
                         [("cuda", None, "cuda:0"), ("cuda", "1", "cuda:1"), ("cuda:1", None, "cuda:1"),
                          (None, "1", "cuda:1"), ("cpu", "1", "cpu")])
def test_resolve_device_gives_set_device_an_index(monkeypatch: pytest.MonkeyPatch, requested: str | None,
                                                   local_rank: str | None, expected: str) -> None:
    """`--device cuda` once failed in torch.cuda.set_device, which refuses a CUDA device without an index."""
    import torch

    from dflash_train.commands.data_args import resolve_device

    current: list[torch.device] = []

    def set_device(device: torch.device) -> None:
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        current.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device(requested) == expected
    assert [str(d) for d in current] == ([expected] if expected != "cpu" else [])
    if requested != "cpu":  # a rank past the GPUs there are: one line, before any device is touched
        monkeypatch.setenv("LOCAL_RANK", "2")
        with pytest.raises(ValueError, match=r"^LOCAL_RANK 2 asks for cuda:2, but this machine has 2 CUDA device"):
            resolve_device(None if requested is None else "cuda")
        assert len(current) == (1 if expected != "cpu" else 0)
