"""A Hub id (`org/name`, not on disk) without network fails at once, in one line, instead of after the Hub
client's ~25 s of retries; a copy in the local Hub cache is used instead when there is one. The network is
never used here: the one request of the reachability probe is replaced."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

import dflash_train.target.loading as loading
from dflash_train.cli import main
from dflash_train.data.target_tokenizer import load_target_tokenizer
from dflash_train.target import load_target, load_target_config
from tests.helpers.training import save_tiny_target


@pytest.fixture
def hub_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every load from the Hub, recorded instead of made (each would retry for ~25 s without network)."""
    asked: list[str] = []

    def offline(source: str, *args: object, **kwargs: object) -> None:
        asked.append(str(source))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    for name in ("AutoModelForCausalLM", "AutoTokenizer"):
        monkeypatch.setattr(getattr(loading, name), "from_pretrained", offline)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", offline)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    return asked


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The probe's request fails as on a machine without network; records the timeouts it was given."""
    timeouts: list[float] = []

    def head(url: str, *, timeout: float, **kwargs: object) -> None:
        timeouts.append(timeout)
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(httpx, "head", head)
    monkeypatch.setattr(loading, "snapshot_download", _not_cached)
    return timeouts


def _not_cached(repo_id: str, **kwargs: object) -> str:
    from huggingface_hub.errors import LocalEntryNotFoundError

    assert kwargs.get("local_files_only") is True  # the cache only: never a download
    raise LocalEntryNotFoundError(f"{repo_id} is not in the cache")


UNREACHABLE = ("Target 'some-org/some-model' is not a local path and the Hub is unreachable: https://huggingface.co "
               "did not answer ([Errno -2] Name or service not known); connect to the network, or pass a local model "
               "directory, a .gguf file or an alias (smollm2-135m-instruct).")


@pytest.mark.parametrize("load", [load_target, load_target_tokenizer, load_target_config])
def test_a_hub_id_without_network_fails_at_once_in_one_line(load: object, hub_lookups: list[str],
                                                           no_network: list[float]) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError) as error:
        load("some-org/some-model")  # type: ignore[operator]
    assert str(error.value) == UNREACHABLE
    assert not hub_lookups and no_network and max(no_network) <= 5  # one short probe, no retried lookups
    assert time.monotonic() - started < 5


def test_the_command_line_says_so_in_one_line(hub_lookups: list[str], no_network: list[float],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--target", "some-org/some-model"]) == 2
    assert capsys.readouterr().err.strip() == f"dflash-train inspect: error: {UNREACHABLE}"


def test_a_copy_in_the_local_hub_cache_is_used_without_network(tmp_path: Path, no_network: list[float],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cached = save_tiny_target(tmp_path / "snapshot")
    monkeypatch.setattr(loading, "snapshot_download",
                        lambda repo_id, local_files_only: str(cached) if local_files_only else "")
    loaded: list[str] = []
    load_model = loading.AutoModelForCausalLM.from_pretrained

    def spy(source: str, *args: object, **kwargs: object) -> object:
        loaded.append(str(source))
        return load_model(source, *args, **kwargs)

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", spy)
    target = load_target("some-org/some-model", dtype=torch.float32)
    assert target.num_layers == 6 and loaded == [str(cached)]


def test_a_reachable_hub_is_asked(hub_lookups: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpx, "head", lambda url, timeout: httpx.Response(200))
    with pytest.raises(ValueError, match="Could not load target 'some-org/some-model'"):
        load_target("some-org/some-model")
    assert hub_lookups == ["some-org/some-model"]


def test_offline_mode_reads_the_cache_without_a_probe(hub_lookups: list[str], no_network: list[float],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # from_pretrained looks in the cache only
    with pytest.raises(ValueError, match="Could not load target 'some-org/some-model'"):
        load_target("some-org/some-model")
    assert hub_lookups == ["some-org/some-model"] and not no_network
