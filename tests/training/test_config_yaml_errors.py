"""YAML syntax errors in a recipe or an override are one-line errors naming where and what, not tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.training.config import load_config
from tests.helpers.paths import CPU_RECIPE

RECIPE = CPU_RECIPE


def test_recipe_syntax_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  target: smollm2-135m-instruct\ntraining:\n  learning_rate: [1e-3\n  batch_size: 2\n")
    with pytest.raises(ValueError, match=rf"^{recipe}, line \d+, column \d+: .+; fix the YAML") as error:
        load_config(recipe)
    assert "\n" not in str(error.value)


def test_tab_indentation_in_a_recipe_is_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "tabs.yaml"
    recipe.write_text("training:\n\tbatch_size: 2\n")
    with pytest.raises(ValueError, match=rf"^{recipe}, line 2, column 1: ") as error:
        load_config(recipe)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("override", ["model.target_layer_ids=[1, 2", "training.run_name={a: 1", "model.target=a: b: c"])
def test_override_syntax_error_names_the_override(override: str) -> None:
    with pytest.raises(ValueError, match=r"^override '.+': YAML value .*line 1, column \d+") as error:
        load_config(RECIPE, [override])
    message = str(error.value)
    assert override in message and "\n" not in message


def test_train_command_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("training: {batch_size: 2\n")
    assert main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dflash-train train: error: {recipe}, line ") and "\n" not in err
