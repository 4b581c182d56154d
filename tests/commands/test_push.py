"""`dflash-train push`: dry run, and every failure (token, repo id, network, broken export) as one line.

No test reaches the network: the Hub is put in offline mode or pointed at a closed local port.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dflash_train.cli import main
from tests.helpers.checkpoints import export_tiny
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture
def export(tmp_path: Path) -> Path:
    return export_tiny(tmp_path, make_tiny_target("qwen3", num_layers=6, seed=1))


@pytest.fixture
def no_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No token anywhere: not in the environment, not in a token file."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr("huggingface_hub.constants.HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train push: error:") and "\n" not in err, err
    return err


def test_dry_run_lists_the_files_and_sends_nothing(
    export: Path, capsys: pytest.CaptureFixture[str], no_login: None
) -> None:
    (export / ".cache").mkdir()
    (export / ".cache" / "junk").write_text("x")
    assert main(["push", str(export), "--repo-id", "my-org/tiny-dflash", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[-1] for line in out.splitlines()[:-1]]
    assert listed == ["README.md", "config.json", "dflash.py", "model.safetensors"]
    size = (export / "model.safetensors").stat().st_size
    assert f"{size:,d}" in out and "would upload 4 files" in out and "my-org/tiny-dflash" in out


def test_missing_token(export: Path, capsys: pytest.CaptureFixture[str], no_login: None) -> None:
    assert main(["push", str(export), "--repo-id", "my-org/tiny-dflash"]) == 2
    assert "no Hugging Face token" in one_line_error(capsys)


@pytest.mark.parametrize("repo_id", ["tiny-dflash", "my-org/", "my org/x", "a/b/c", "org/..x", "org/name-"])
def test_bad_repo_id(export: Path, capsys: pytest.CaptureFixture[str], repo_id: str) -> None:
    assert main(["push", str(export), "--repo-id", repo_id, "--dry-run"]) == 2
    assert "invalid repo id" in one_line_error(capsys)


def test_broken_export_is_not_pushed(export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (export / "dflash.py").unlink()
    assert main(["push", str(export), "--repo-id", "my-org/tiny-dflash", "--dry-run"]) == 2
    assert "fails `dflash-train check`" in one_line_error(capsys)


def test_offline_is_one_line(export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert main(["push", str(export), "--repo-id", "my-org/tiny-dflash"]) == 2
    assert "offline mode is on" in one_line_error(capsys)


def test_unreachable_hub_fails_fast(export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    start = time.monotonic()
    assert main(["push", str(export), "--repo-id", "my-org/tiny-dflash"]) == 2
    assert "cannot reach the Hub" in one_line_error(capsys)
    assert time.monotonic() - start < 30
