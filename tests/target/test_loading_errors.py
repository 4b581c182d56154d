"""Target names that cannot work fail at once, in one line: a truncated GGUF says so with both sizes, a
mistyped alias gets a suggestion, and a name that can only be a local path is never looked up on the Hub
(whose lookup retries for about 25 s without network)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dflash_train.target.loading as loading
from dflash_train.cli import main
from dflash_train.target import load_target, load_target_config
from tests.helpers.tiny_models import write_tiny_gguf


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Records every Hub lookup instead of making it (each would fail like an offline machine's)."""
    asked: list[str] = []

    def offline(source: str, *args: object, **kwargs: object) -> None:
        asked.append(str(source))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", offline)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)  # the Hub answers; its lookups fail
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    return asked


def truncated_gguf(tmp_path: Path, keep: int) -> tuple[Path, int]:
    path = write_tiny_gguf(tmp_path / "model.gguf")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:keep] if keep > 0 else path.read_bytes()[:size + keep])
    return path, size


def test_truncated_gguf_names_the_file_and_both_sizes(tmp_path: Path, no_hub: list[str]) -> None:
    path, _ = truncated_gguf(tmp_path, keep=-100)
    expected = r"model\.gguf is truncated: [\d,]+ of [\d,]+ bytes \([\d,]+ missing\); download or copy"
    with pytest.raises(ValueError, match=expected):
        load_target(str(path))
    with pytest.raises(ValueError, match=expected):
        load_target_config(str(path))
    assert not no_hub


def test_gguf_cut_inside_its_header(tmp_path: Path, no_hub: list[str]) -> None:
    path, _ = truncated_gguf(tmp_path, keep=40)
    with pytest.raises(ValueError, match=r"model\.gguf is truncated: it ends inside its header \(40 bytes\)"):
        load_target(str(path))


def test_check_with_a_truncated_gguf_target_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = truncated_gguf(tmp_path, keep=-100)
    assert main(["check", str(tmp_path), "--target", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train check: error:") and "model.gguf is truncated: " in err and "\n" not in err


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2", "SmolLM2-135M-instruct", "smolm2-135m-instruct"])
def test_a_mistyped_alias_gets_a_suggestion_without_a_hub_lookup(name: str, no_hub: list[str]) -> None:
    with pytest.raises(ValueError, match="did you mean the alias 'smollm2-135m-instruct'"):
        load_target(name)
    assert not no_hub


@pytest.mark.parametrize("name", ["runs/model.safetensors", "outputs/target.bin", "org/model.gguf",
                                  "my--org/model", "org/-model", "a/b/c"])
def test_a_name_that_can_only_be_a_local_path_is_not_looked_up(name: str, no_hub: list[str]) -> None:
    with pytest.raises(ValueError, match=f"No target model at '{name}'"):
        load_target(name)
    assert not no_hub


def test_a_hub_id_is_still_looked_up_and_fails_in_one_line(no_hub: list[str]) -> None:
    with pytest.raises(ValueError, match="Could not load target 'some-org/some-model'") as error:
        load_target("some-org/some-model")
    assert no_hub == ["some-org/some-model"] and "\n" not in str(error.value)
