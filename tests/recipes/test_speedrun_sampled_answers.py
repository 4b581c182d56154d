"""SAMPLED_MINUTES: the speedrun answers its prompts once more at a temperature, after the greedy answers and for
minutes of their own, and prepares both sets together (what the script hands its commands,
`tests.helpers.speedrun_shims`)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from tests.helpers.paths import REPO
from tests.helpers.speedrun_shims import run_stage, timeout_recorded


def regenerations(calls: list[list[str]]) -> list[list[str]]:
    return [args for args in calls if "regenerate" in args]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_sampled_answers_follow_the_greedy_ones_for_their_own_minutes(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    timeout_recorded(tmp_path)
    calls = [c.split() for c in run_stage("data", tmp_path, REGEN_MINUTES="2.5", SAMPLED_MINUTES="1.5",
                                          SELF_PROMPTS="0")]
    assert [c for c in calls if c[0] == "timeout"] == [["timeout", "150s"], ["timeout", "90s"]]
    greedy, sampled = regenerations(calls)
    assert flag(greedy, "--out") == str(run / "regen") and flag(greedy, "--temperature") is None
    assert flag(sampled, "--out") == str(run / "regen-sampled")
    assert flag(sampled, "--temperature") == "1.0" and "--samples-per-prompt" not in sampled
    assert flag(sampled, "--data") == flag(greedy, "--data") == str(run / "prompts.jsonl")
    prepares = [args for args in calls if "prepare" in args]
    assert [[p[i + 1] for i, a in enumerate(p) if a == "--data"] for p in prepares] == [
        [str(run / "regen"), str(run / "regen-sampled")]]
    assert flag(prepares[0], "--out") == str(run / "prepared")
    assert (run / "regen-sampled.done").exists()
    (run / "prepared").mkdir()
    (run / "prepared" / "dflash_data.json").write_text("{}")
    assert not regenerations([c.split() for c in run_stage("data", tmp_path, SAMPLED_MINUTES="1.5")])


def test_a_call_cut_after_the_greedy_answers_still_samples_and_keeps_both(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    timeout_recorded(tmp_path)
    run.mkdir()
    (run / "regen.budget-spent").touch()  # an earlier call's greedy answers, stopped by REGEN_MINUTES
    calls = [c.split() for c in run_stage("data", tmp_path, SAMPLED_MINUTES="1", SAMPLED_TEMPERATURE="0.7")]
    (sampled,) = regenerations(calls)
    assert flag(sampled, "--out") == str(run / "regen-sampled") and flag(sampled, "--temperature") == "0.7"
    (prepare,) = [args for args in calls if "prepare" in args]
    assert [prepare[i + 1] for i, a in enumerate(prepare) if a == "--data"] == [str(run / "regen"),
                                                                               str(run / "regen-sampled")]
    assert "--allow-unfinished" in prepare  # the greedy answers' finished shards


def test_without_sampled_minutes_only_greedy_answers_are_prepared(tmp_path: pathlib.Path) -> None:
    timeout_recorded(tmp_path)
    calls = [c.split() for c in run_stage("data", tmp_path, SELF_PROMPTS="0")]
    (greedy,) = regenerations(calls)
    assert flag(greedy, "--temperature") is None
    (prepare,) = [args for args in calls if "prepare" in args]
    assert [prepare[i + 1] for i, a in enumerate(prepare) if a == "--data"] == [str(tmp_path / "run" / "regen")]


@pytest.mark.parametrize("settings, message", [
    ({"SAMPLED_MINUTES": "some"}, "SAMPLED_MINUTES must be a number of minutes, not 'some'"),
    ({"SAMPLED_MINUTES": "1", "SAMPLED_TEMPERATURE": "0"},
     "SAMPLED_TEMPERATURE must be a temperature above 0 (sampled answers), not '0'"),
])
def test_bad_sampled_settings_stop_the_run_before_it_starts(tmp_path: pathlib.Path, settings: dict[str, str],
                                                            message: str) -> None:
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prompts"], cwd=REPO,
                          env={**os.environ, "OUT": str(tmp_path / "run"), **settings},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == message
