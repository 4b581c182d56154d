"""The typed training config: recipes parse, overrides apply, mistakes are one-line errors."""

from __future__ import annotations

import ast
import pathlib
import re
import shlex

import pytest
import yaml

from dflash_train.training import config as config_module
from dflash_train.training.config import load_config
from dflash_train.training.trainer import check_deepspeed_accumulation
from tests.helpers.paths import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_the_module_docstrings_example_loads() -> None:
    """The usage example named fields that do not exist (`training.lr`, `data.online`)."""
    call = re.search(r"load_config\((.*)\)", config_module.__doc__ or "")
    assert call is not None
    recipe, overrides = ast.literal_eval(f"({call.group(1)})")
    load_config(str(REPO / recipe), overrides)  # an unknown key would be a ValueError


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses(recipe: pathlib.Path) -> None:
    config = load_config(recipe)
    assert config.model.block_size in (10, 16)
    assert config.training.num_anchors >= 32


def test_paper_recipes_follow_the_spec() -> None:
    for name, block in (("qwen3-8b-dflash-b16", 16), ("qwen3-4b-dflash-b16", 16), ("llama-3.1-8b-instruct-dflash-b10", 10)):
        c = load_config(pathlib.Path("recipes") / f"{name}.yaml")
        assert (c.model.num_draft_layers, c.model.block_size, c.training.num_anchors) == (5, block, 512)
        assert (c.training.learning_rate, c.training.warmup_ratio, c.training.max_grad_norm) == (6e-4, 0.04, 1.0)
        assert (c.training.epochs, c.data.max_length, c.training.weight_decay) == (6, 3072, 0.0)
        assert c.training.mixed_precision == "bf16"


def header_launches(recipe: pathlib.Path) -> list[list[str]]:
    """The `accelerate launch ...` commands a recipe's header comment shows, continuation lines joined."""
    header = "".join(line.removeprefix("#") for line in recipe.read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    return [shlex.split(line) for line in header.replace("\\\n", " ").splitlines() if "accelerate launch" in line]


def test_a_recipes_deepspeed_launch_accumulates_as_the_recipe_does() -> None:
    """A launch a recipe shows under DeepSpeed passes the trainer's check that DeepSpeed accumulates as many
    micro-batches as `training.gradient_accumulation_steps` (accelerate's --gradient_accumulation_steps, else the
    launch config's)."""
    shown = 0
    for recipe in RECIPES:
        for argv in header_launches(recipe):
            config_file = REPO / argv[argv.index("--config_file") + 1]
            launch = yaml.safe_load(config_file.read_text())
            assert argv[argv.index("--config") + 1] == f"recipes/{recipe.name}", argv
            if launch["distributed_type"] != "DEEPSPEED":
                continue
            steps = launch["deepspeed_config"].get("gradient_accumulation_steps", "auto")
            if "--gradient_accumulation_steps" in argv:
                steps = argv[argv.index("--gradient_accumulation_steps") + 1]
            check_deepspeed_accumulation({"gradient_accumulation_steps": steps},
                                         load_config(recipe).training.gradient_accumulation_steps)
            shown += 1
    assert shown >= 3  # the paper recipes


def test_overrides_are_typed() -> None:
    c = load_config(RECIPES[0], ["training.learning_rate=1e-4", "model.mask_token_id=16", "training.max_steps=7",
                                 "model.target_layer_ids=[1, 2]", "training.mixed_precision=no"])
    assert c.training.learning_rate == 1e-4 and c.model.mask_token_id == 16 and c.training.max_steps == 7
    assert c.model.target_layer_ids == [1, 2] and c.training.mixed_precision == "no"


@pytest.mark.parametrize(
    "override,message",
    [
        ("training.learning_rat=1", "unknown config key training.learning_rat (did you mean training.learning_rate?)"),
        ("training.batch_size=two", "training.batch_size='two' must be of type int"),
        ("training.attention=sparse", "training.attention='sparse' is not one of"),
        ("training.batch_size=0", "training.batch_size must be >= 1"),
        ("training.log_every=0", "training.log_every must be >= 1"),  # the loop divides by both
        ("training.save_every=0", "training.save_every must be >= 1"),
        # 0 fell back to the epochs, a negative count saved an untrained drafter, a gamma of 0 gave a NaN loss
        ("training.max_steps=0", "training.max_steps must be >= 1, got 0"),
        ("training.max_steps=-5", "training.max_steps must be >= 1, got -5"),
        ("training.epochs=0", "training.epochs must be > 0, got 0"),
        ("training.loss_decay_gamma=0", "training.loss_decay_gamma must be > 0, got 0.0"),
        ("training.loss_decay_gamma=-4", "training.loss_decay_gamma must be > 0, got -4.0"),
        # each ran on after the target loaded: a division by zero, an IndexError in Adam, a learning rate that
        # climbed to 5x its peak
        ("data.pad_to_multiple=0", "data.pad_to_multiple must be >= 1, got 0"),
        ("training.adam_betas=[0.9]", "training.adam_betas must be two numbers in [0, 1), got [0.9]"),
        ("training.adam_betas=[0.9, 0.99, 0.5]", "training.adam_betas must be two numbers in [0, 1), got [0.9, 0.99, 0.5]"),
        ("training.adam_betas=[0.9, 1.5]", "training.adam_betas must be two numbers in [0, 1), got [0.9, 1.5]"),
        ("training.min_lr_ratio=5", "training.min_lr_ratio must be in [0, 1], got 5.0"),
        ("training.warmup_ratio=-1", "training.warmup_ratio must be in [0, 1], got -1.0"),
        ("training.learning_rate=0", "training.learning_rate must be > 0, got 0.0"),
        ("model.block_size=32", "no default loss-decay gamma for block_size=32"),
        ("trainer.steps=1", "unknown config key trainer"),
        ("training.seed", "must look like section.key=value"),
    ],
)
def test_mistakes_are_clear_errors(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(RECIPES[0], [override])


def test_epochs_apply_only_without_max_steps_and_gamma_may_be_infinite() -> None:
    c = load_config(RECIPES[0], ["training.max_steps=3", "training.epochs=0", "training.loss_decay_gamma=.inf"])
    assert c.training.max_steps == 3 and c.training.loss_decay_gamma == float("inf")


def test_exactly_one_data_source(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="exactly one of data.prepared"):
        load_config(None, [])
    with pytest.raises(ValueError, match="exactly one of data.prepared"):
        load_config(None, ["data.prepared=a", "data.features=b"])
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_deepspeed_accumulation_must_match_the_run() -> None:
    from dflash_train.training.trainer import check_deepspeed_accumulation

    check_deepspeed_accumulation({"gradient_accumulation_steps": 2}, 2)
    check_deepspeed_accumulation({"gradient_accumulation_steps": "auto"}, 4)
    check_deepspeed_accumulation({}, 4)
    with pytest.raises(ValueError, match="sets gradient_accumulation_steps: 1 but training.gradient_accumulation_steps=4"):
        check_deepspeed_accumulation({"gradient_accumulation_steps": 1}, 4)


def test_what_a_launch_decides_sharding_and_the_autocast_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cast-weight cache goes off only where steps can be captured: step graphs asked for, CUDA, and one
    process or DDP (accelerate's launch says FSDP or DeepSpeed in the environment)."""
    from dflash_train.training import launch

    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    for variable in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(variable, raising=False)
    assert launch.sharding_launch() is None
    assert launch.autocast_cache_off(True) and not launch.autocast_cache_off(False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert launch.sharding_launch() == "FSDP" and not launch.autocast_cache_off(True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "True")
    assert launch.sharding_launch() == "DeepSpeed" and not launch.autocast_cache_off(True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)
    assert not launch.autocast_cache_off(True)
