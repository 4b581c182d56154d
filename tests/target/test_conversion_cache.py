"""The converted-GGUF cache is keyed by the file's content: copies of one file in two clones share one
conversion, different files of one name never evict each other, conversions are published whole, and a
whole conversion is never removed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import dflash_train.target.conversion as conversion
from dflash_train.target import CONVERSION_MARKER, content_digest, ensure_converted_gguf, load_target
from tests.helpers.tiny_models import make_tiny_target, write_tiny_gguf

GGUF_NAME = "tiny.Q8_0.gguf"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replaces the GGUF dequantisation (seconds for a real model) by a tiny model seeded from the file's
    first tensor, and records which files were converted."""
    converted: list[Path] = []

    def fake_load_gguf(path: Path, dtype: torch.dtype) -> tuple[object, object]:
        converted.append(path)
        import gguf

        seed = int(abs(gguf.GGUFReader(path).tensors[0].data[0, 0]) * 1000)
        target = make_tiny_target("qwen3", num_layers=2, seed=seed)
        return target.model.to(dtype), target.tokenizer

    monkeypatch.setattr(conversion, "load_gguf", fake_load_gguf)
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    return converted


def test_two_clones_share_one_conversion(tmp_path: Path, conversions: list[Path]) -> None:
    first = write_tiny_gguf(tmp_path / "clone-a" / GGUF_NAME)
    second = tmp_path / "clone-b" / GGUF_NAME
    second.parent.mkdir()
    shutil.copyfile(first, second)
    out = ensure_converted_gguf(first)
    inode = (out / "model.safetensors").stat().st_ino
    for path in (second, first, second):
        assert ensure_converted_gguf(path) == out
        load_target(str(path))
    assert conversions == [first]  # converted once, never again from the other clone
    assert (out / "model.safetensors").stat().st_ino == inode  # the folder others read was never replaced


def test_different_files_of_one_name_do_not_evict_each_other(tmp_path: Path, conversions: list[Path]) -> None:
    one = write_tiny_gguf(tmp_path / "clone-a" / GGUF_NAME, seed=0)
    two = write_tiny_gguf(tmp_path / "clone-b" / GGUF_NAME, seed=1)
    out_one, out_two = ensure_converted_gguf(one), ensure_converted_gguf(two)
    assert out_one != out_two
    for _ in range(2):
        assert ensure_converted_gguf(one) == out_one and ensure_converted_gguf(two) == out_two
    assert conversions == [one, two] and out_one.is_dir() and out_two.is_dir()
    assert not torch.equal(load_target(str(one)).embed_tokens.weight, load_target(str(two)).embed_tokens.weight)


def test_an_edited_file_gets_a_new_conversion_and_the_old_one_stays(tmp_path: Path, conversions: list[Path]) -> None:
    gguf = write_tiny_gguf(tmp_path / GGUF_NAME, seed=0)
    old = ensure_converted_gguf(gguf)
    write_tiny_gguf(gguf, seed=1)
    new = ensure_converted_gguf(gguf)
    assert new != old and old.is_dir() and len(conversions) == 2


def test_a_failed_conversion_leaves_nothing_behind(tmp_path: Path, conversions: list[Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_gguf(tmp_path / GGUF_NAME)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversion.PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError):
        ensure_converted_gguf(gguf)
    cache = tmp_path / "cache" / "targets"
    assert [p.name for p in cache.iterdir()] == [conversion.DIGESTS_DIR]  # no partial folder, no temp dir


def test_a_damaged_conversion_is_converted_again(tmp_path: Path, conversions: list[Path]) -> None:
    gguf = write_tiny_gguf(tmp_path / GGUF_NAME)
    out = ensure_converted_gguf(gguf)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert ensure_converted_gguf(gguf) == out and len(conversions) == 2
    load_target(str(gguf))
    assert (out / CONVERSION_MARKER).is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_content_digest_follows_the_bytes(tmp_path: Path) -> None:
    memo = tmp_path / "memo"
    a = write_tiny_gguf(tmp_path / "a" / GGUF_NAME, seed=0)
    b = tmp_path / "b.gguf"
    shutil.copyfile(a, b)
    assert content_digest(a, memo) == content_digest(b, memo)
    write_tiny_gguf(b, seed=1)  # same size, other bytes
    assert content_digest(a, memo) != content_digest(b, memo)


def test_one_reading_of_the_file_writes_the_bf16_and_float32_copies(tmp_path: Path, conversions: list[Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 conversion reads the file once in float32 and writes both copies: the eval's float32 check then
    finds its copy. The bf16 copy is the float32 one rounded, as a bf16 load of the file rounds it."""
    path = write_tiny_gguf(tmp_path / GGUF_NAME)
    bf16 = ensure_converted_gguf(path)
    fp32 = ensure_converted_gguf(path, torch.float32)
    assert conversions == [path] and fp32 == conversion.converted_gguf_dir(path, torch.float32)
    half = load_target(str(bf16)).model.state_dict()
    full = load_target(str(fp32), dtype=torch.float32).model.state_dict()
    assert all(full[name].dtype == torch.float32 and torch.equal(half[name], full[name].to(torch.bfloat16))
               for name in half)
    assert ensure_converted_gguf(path, torch.float16) and conversions == [path, path]  # fp16: a reading of its own
    # A large target writes only the copy asked for (a float32 copy of billions of weights is not free).
    monkeypatch.setattr(conversion, "PAIRED_MAX_FP32_BYTES", 0)
    other = write_tiny_gguf(tmp_path / "other" / GGUF_NAME, seed=7)
    ensure_converted_gguf(other)
    assert not conversion.converted_gguf_dir(other, torch.float32).exists()
