"""Import and export round trips: the published z-lab layout imports, and export(import(x)) == x."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_train.checkpoint import check_checkpoint, export_checkpoint, load_draft, save_draft
from dflash_train.checkpoint.hf_format import config_from_hf, expected_tensor_shapes
from dflash_train.checkpoint.weights import INDEX_FILE, read_tensors
from tests.helpers.checkpoints import (
    ZLAB_QWEN3_8B_CONFIG,
    tiny_draft_for,
    write_zlab_checkpoint,
    zlab_tensors,
    zlab_tiny_config,
)
from tests.helpers.tiny_models import make_tiny_target


def stored(directory: Path) -> dict[str, torch.Tensor]:
    return read_tensors(directory)


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name


def test_published_config_parses_to_the_published_drafter() -> None:
    config = config_from_hf(ZLAB_QWEN3_8B_CONFIG)
    assert (config.num_hidden_layers, config.hidden_size, config.block_size) == (5, 4096, 16)
    assert config.mask_token_id == 151669 and config.target_layer_ids == [1, 9, 17, 25, 33]
    assert (config.num_target_layers, config.rope_theta, config.rope_scaling) == (36, 1e6, None)
    shapes = expected_tensor_shapes(config)
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert len(shapes) == 3 + 5 * 11
    # the hand-written names of the tiny fixture agree with the package's expectation
    tiny = zlab_tiny_config()
    assert {k: tuple(v.shape) for k, v in zlab_tensors(tiny).items()} == expected_tensor_shapes(config_from_hf(tiny))


def test_zlab_layout_imports_with_every_setting(tmp_path: Path) -> None:
    config, tensors = write_zlab_checkpoint(tmp_path / "zlab")
    draft = load_draft(tmp_path / "zlab")
    assert draft.config.mask_token_id == 300 and draft.config.target_layer_ids == [1, 3]
    assert (draft.config.block_size, draft.config.num_target_layers, draft.config.rope_theta) == (16, 6, 10000.0)
    assert draft.fc.weight.dtype == torch.bfloat16  # stored dtype kept
    assert torch.equal(draft.layers[1].mlp.down_proj.weight, tensors["layers.1.mlp.down_proj.weight"])
    assert draft.rotary_emb.inv_freq.dtype == torch.float32 and not draft.rotary_emb.inv_freq.is_meta


def test_export_of_import_reproduces_tensors_and_config_keys(tmp_path: Path) -> None:
    source, tensors = write_zlab_checkpoint(tmp_path / "zlab", seed=3)
    save_draft(load_draft(tmp_path / "zlab"), tmp_path / "resaved")
    out = export_checkpoint(tmp_path / "zlab", tmp_path / "export")
    for directory in (tmp_path / "resaved", out):
        assert_bit_exact(stored(directory), tensors)
        written = json.loads((directory / "config.json").read_text())
        for key, value in source.items():
            if key != "transformers_version":
                assert written[key] == value, key
        assert "eagle_aux_hidden_state_layer_ids" not in written
    assert check_checkpoint(out) == []


def test_older_layout_without_block_size_in_dflash_config_imports(tmp_path: Path) -> None:
    config = zlab_tiny_config(block_size=8, rope_theta=500000)
    config["dflash_config"] = {"mask_token_id": 5, "target_layer_ids": [2, 3]}
    write_zlab_checkpoint(tmp_path / "old", config)
    draft = load_draft(tmp_path / "old")
    assert (draft.config.block_size, draft.config.mask_token_id, draft.config.rope_theta) == (8, 5, 500000.0)
    out = export_checkpoint(tmp_path / "old", tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [2, 3], "block_size": 8}


def test_model_prefix_is_tolerated_on_import_and_stripped_on_export(tmp_path: Path) -> None:
    _, tensors = write_zlab_checkpoint(tmp_path / "prefixed", prefix="model.")
    draft = load_draft(tmp_path / "prefixed")
    assert torch.equal(draft.fc.weight, tensors["fc.weight"])
    out = export_checkpoint(tmp_path / "prefixed", tmp_path / "export")
    assert_bit_exact(stored(out), tensors)


def test_missing_or_unexpected_tensor_is_a_clear_error(tmp_path: Path) -> None:
    config, tensors = write_zlab_checkpoint(tmp_path / "zlab")
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "zlab" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 drafter tensors.*layers\.1\.self_attn\.k_norm\.weight"):
        load_draft(tmp_path / "zlab")
    tensors["layers.1.self_attn.k_norm.weight"] = torch.ones(16)
    tensors["lm_head.weight"] = torch.zeros(320, 64)
    save_file(tensors, str(tmp_path / "zlab" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors.*lm_head\.weight"):
        load_draft(tmp_path / "zlab")


def test_save_load_round_trip_keeps_logits(tmp_path: Path) -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    draft = tiny_draft_for(target)
    save_draft(draft, tmp_path / "fp32", dtype=torch.float32)
    loaded = load_draft(tmp_path / "fp32")
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    features, embeds = torch.randn(1, 7, 2 * 64), torch.randn(1, 4, 64)
    outputs = []
    for model in (draft, loaded):
        cache = model.new_cache(1, 16)
        model.extend_context(cache, features, torch.arange(7)[None])
        outputs.append(model.draft_block(cache, embeds, torch.arange(7, 11)[None]))
    assert torch.equal(outputs[0], outputs[1])


def test_sharded_save_loads_back_and_keeps_other_files(tmp_path: Path) -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    draft = tiny_draft_for(target)
    out = tmp_path / "ckpt"
    save_draft(draft, out)  # single file first
    (out / "optimizer.pt").write_text("kept")
    save_draft(draft, out, max_shard_bytes=40_000)  # then sharded into the same directory
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert (out / "optimizer.pt").read_text() == "kept"
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as handle:
            assert sum(handle.get_slice(k).get_shape()[0] for k in handle.keys()) > 0  # noqa: SIM118
    assert_bit_exact(stored(out), {k: v.to(torch.bfloat16) for k, v in draft.state_dict().items()})
    save_draft(draft, out)  # back to one file: stale shards and index removed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "optimizer.pt"]


def test_extra_config_is_kept_but_cannot_override(tmp_path: Path) -> None:
    draft = tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1))
    out = save_draft(draft, tmp_path / "ckpt", extra_config={"dflash_train": {"step": 7}})
    assert json.loads((out / "config.json").read_text())["dflash_train"] == {"step": 7}
    with pytest.raises(ValueError, match="rope_theta"):
        save_draft(draft, tmp_path / "other", extra_config={"rope_theta": 1.0})


def test_export_replaces_only_an_earlier_exports_files(tmp_path: Path) -> None:
    write_zlab_checkpoint(tmp_path / "zlab")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    (busy / "README.md").write_text("the user's own")
    for overwrite in (False, True):  # a file of an export's name that no export wrote is never replaced
        with pytest.raises(ValueError, match="--overwrite" if not overwrite else "that no export wrote"):
            export_checkpoint(tmp_path / "zlab", busy, overwrite=overwrite)
    assert sorted(p.name for p in busy.iterdir()) == ["README.md", "notes.txt"]
    export_checkpoint(tmp_path / "zlab", tmp_path / "out")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--overwrite"):
        export_checkpoint(tmp_path / "zlab", tmp_path / "out")
    export_checkpoint(tmp_path / "zlab", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"  # the user's file stays
    assert (tmp_path / "out" / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_export_refuses_a_folder_that_holds_its_source(tmp_path: Path) -> None:
    write_zlab_checkpoint(tmp_path / "run" / "zlab")
    with pytest.raises(ValueError, match="holds the input"):
        export_checkpoint(tmp_path / "run" / "zlab", tmp_path / "run", overwrite=True)
    assert (tmp_path / "run" / "zlab").is_dir()


def test_export_against_a_mismatched_target_fails_before_writing(tmp_path: Path) -> None:
    write_zlab_checkpoint(tmp_path / "zlab")
    wrong = make_tiny_target("qwen3", num_layers=8, seed=1).config
    with pytest.raises(ValueError, match="num_target_layers 6 != the target's 8"):
        export_checkpoint(tmp_path / "zlab", tmp_path / "out", target=wrong)
    assert not (tmp_path / "out").exists()


def test_hub_id_without_network_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="Hub") as error:
        load_draft("z-lab/Qwen3-8B-DFlash-b16")
    assert "\n" not in str(error.value)


def test_compiled_submodules_save_under_plain_names(tmp_path: Path) -> None:
    draft = tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1))
    draft.layers[0] = torch.compile(draft.layers[0])  # wraps: weights become layers.0._orig_mod.*
    out = save_draft(draft, tmp_path / "ckpt")
    names = set(stored(out))
    assert "layers.0.self_attn.q_proj.weight" in names and not any("_orig_mod" in n for n in names)


def test_a_training_checkpoint_folder_resolves_to_its_draft(tmp_path: Path) -> None:
    _, tensors = write_zlab_checkpoint(tmp_path / "checkpoints" / "step-00000100" / "draft")
    (tmp_path / "checkpoints" / "step-00000100" / "state").mkdir()
    draft = load_draft(tmp_path / "checkpoints" / "step-00000100")
    assert torch.equal(draft.norm.weight, tensors["norm.weight"])
