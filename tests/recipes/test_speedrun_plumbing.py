"""What the speedrun script hands its commands, without running them (`tests.helpers.speedrun_shims`)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from tests.helpers.paths import REPO
from tests.helpers.speedrun_shims import SHIM, TIMEOUT_SHIM, run_stage

SLOW_REGEN_SHIM = SHIM.replace("exit 0", '[[ "$*" == *" regenerate "* ]] && sleep 60\nexit 0')


def test_regeneration_without_the_prompts_stage_says_to_run_it_first(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "run"), "TARGET": str(tmp_path / "absent.gguf")}
    for stage in ("regenerate", "data"):
        done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), stage], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.startswith(f"no prompts at {tmp_path / 'run' / 'prompts.jsonl'}: run the prompts stage")
        assert not (tmp_path / "run" / "times.tsv").exists()  # nothing ran, so nothing counts against the run


def forget_regeneration(tmp_path: pathlib.Path) -> None:
    """Lets the regenerate stage run again in the same folder, as in a fresh one: a finished or spent one is
    skipped, and without their markers earlier rows of times.tsv would count as cut attempts."""
    for marker in ("regen.done", "regen.budget-spent", "times.tsv"):
        (tmp_path / "run" / marker).unlink(missing_ok=True)


def test_a_finished_run_is_not_launched_again(tmp_path: pathlib.Path) -> None:
    assert [c for c in run_stage("train", tmp_path) if "dflash_train.cli train" in c]
    assert not [c for c in run_stage("train", tmp_path, FINISHED="1") if "dflash_train.cli train" in c]


def test_stop_after_reaches_every_training_run(tmp_path: pathlib.Path) -> None:
    train = [c for c in run_stage("train", tmp_path, STOP_AFTER="8.5") if "dflash_train.cli train" in c]
    assert len(train) == 1 and "training.stop_after_minutes=8.5" in train[0].split()
    train = [c for c in run_stage("train", tmp_path) if "dflash_train.cli train" in c]
    assert len(train) == 1 and "stop_after_minutes" not in train[0]


def test_curve_points_are_evaluated_on_their_own_prompts_without_the_lossless_pass(tmp_path: pathlib.Path) -> None:
    calls = run_stage("curve", tmp_path, CURVE_MINUTES="5 10", CURVE_PROMPTS="12", EVAL_PROMPTS="40", STOP_AFTER="9")
    trains = [c.split() for c in calls if "dflash_train.cli train" in c]
    assert [next(a for a in t if a.startswith("training.time_budget_minutes=")) for t in trains] == [
        "training.time_budget_minutes=5", "training.time_budget_minutes=10"]
    assert all("training.stop_after_minutes=9" in t for t in trains)
    evals = [c.split() for c in calls if "dflash_train.cli eval" in c]
    assert len(evals) == 2
    for args in evals:
        assert args[args.index("--num-prompts") + 1] == "12" and "--no-lossless-check" in args
        assert args[args.index("--target-cache") + 1] == str(tmp_path / "run" / "eval" / "target-cache")
    assert calls[-1].startswith("-m recipes.scoring.curve")


def test_the_main_eval_keeps_its_prompts_and_the_lossless_pass(tmp_path: pathlib.Path) -> None:
    calls = run_stage("eval", tmp_path, EVAL_PROMPTS="40", CURVE_PROMPTS="12", FINISHED="1")
    bf16 = [c.split() for c in calls if "dflash_train.cli eval" in c and "float32" not in c]
    batch1 = [args for args in bf16 if "--batch-size" not in args]
    assert len(batch1) == 1
    assert batch1[0][batch1[0].index("--num-prompts") + 1] == "40" and "--no-lossless-check" not in batch1[0]
    # The speedrun's own figures are measured in its own process, never read from another eval's cache.
    assert not [c for c in calls if "--target-cache" in c]


def test_eval_draft_is_evaluated_exported_and_checked_in_place_of_the_main_run(tmp_path: pathlib.Path) -> None:
    brought = tmp_path / "brought" / "draft"  # a drafter trained on another machine; no run here has trained
    brought.mkdir(parents=True)
    (brought / "config.json").write_text("{}")
    calls = run_stage("eval", tmp_path, EVAL_DRAFT=str(brought))
    evals = [c.split() for c in calls if "dflash_train.cli eval" in c]
    assert len(evals) == 3 and all(args[args.index("--draft") + 1] == str(brought) for args in evals)
    (export,) = [c.split() for c in calls if "dflash_train.cli export" in c]
    assert export[export.index("export") + 1] == str(brought)


def test_an_eval_draft_without_a_config_is_a_one_line_error(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "run"), "EVAL_DRAFT": str(tmp_path / "nothing")}
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "eval"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"EVAL_DRAFT={tmp_path / 'nothing'} holds no config.json")


def test_the_bf16_batch8_eval_runs_once_with_its_own_prompts_unless_switched_off(tmp_path: pathlib.Path) -> None:
    calls = run_stage("eval", tmp_path, BATCH8_PROMPTS="12", FINISHED="1")
    (batch8,) = [c.split() for c in calls if "--batch-size 8" in c and "float32" not in c]
    assert batch8[batch8.index("--num-prompts") + 1] == "12" and "--dtype" not in batch8  # bf16 on a GPU
    assert batch8[batch8.index("--out") + 1] == str(tmp_path / "run" / "eval" / "main-b8.json")
    assert "--no-lossless-check" not in batch8 and "--no-compile" not in batch8
    (tmp_path / "run" / "eval" / "main-b8.json").write_text("{}")  # done: not run again
    assert not [c for c in run_stage("eval", tmp_path, FINISHED="1") if "main-b8.json" in c and "cli eval" in c]
    (tmp_path / "run" / "eval" / "main-b8.json").unlink()
    assert not [c for c in run_stage("eval", tmp_path, BATCH8_PROMPTS="0", FINISHED="1")
                if "main-b8.json" in c and "cli eval" in c]


# Records which GPU (LOCAL_RANK) each call ran on; a regeneration rank given RANK_EXIT's rank exits 124, as
# `timeout` does when REGEN_MINUTES runs out.
RANK_SHIM = """#!/usr/bin/env bash
printf '%s\\n' "LOCAL_RANK=${LOCAL_RANK:-none} $*" >> "$CALLS"
if [[ "$1" == "-c" ]] && grep -qF "training.output_dir=$3 " "$CALLS"; then echo "$DRAFT"; fi
if [[ "$*" == *"--rank ${RANK_EXIT:-none} "* ]]; then exit 124; fi
exit 0
"""


def test_gpus_regenerate_one_rank_per_gpu_and_train_under_accelerate(tmp_path: pathlib.Path) -> None:
    calls = run_stage("regenerate", tmp_path, shim=RANK_SHIM, GPUS="2")
    regen = sorted(c.split() for c in calls if "regenerate" in c)
    assert [(c[0], c[c.index("--rank") + 1], c[c.index("--world-size") + 1]) for c in regen] == [
        ("LOCAL_RANK=0", "0", "2"), ("LOCAL_RANK=1", "1", "2")]
    assert not (tmp_path / "run" / "regen.budget-spent").exists()
    train = [c.split() for c in run_stage("train", tmp_path, shim=RANK_SHIM, GPUS="2", RUN_PORT="29777")
             if "dflash_train.train" in c]
    assert len(train) == 1
    args = train[0]
    assert args[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert args[4] == "recipes/accelerate/ddp.yaml" and args[args.index("--num_processes") + 1] == "2"
    assert args[args.index("--main_process_port") + 1] == "29777" and "--config" in args
    one_gpu = [c for c in run_stage("train", tmp_path, shim=RANK_SHIM) if "dflash_train.cli train" in c]
    assert len(one_gpu) == 1 and "accelerate" not in one_gpu[0]


def test_a_rank_stopped_by_regen_minutes_marks_the_budget_spent(tmp_path: pathlib.Path) -> None:
    run_stage("regenerate", tmp_path, shim=RANK_SHIM, GPUS="2", RANK_EXIT="1")
    assert (tmp_path / "run" / "regen.budget-spent").exists()


def test_a_bad_gpu_count_or_launch_config_is_one_line(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "run")}
    for settings, message in (({"GPUS": "two"}, "GPUS must be a whole number of GPUs (1 or more), not 'two'"),
                              ({"GPUS": "0"}, "not '0'"),
                              ({"GPUS": "2", "LAUNCH_CONFIG": "nope.yaml"}, "LAUNCH_CONFIG nope.yaml does not exist")):
        done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "train"], cwd=REPO,
                              env={**env, **settings}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1


def test_self_prompts_are_written_once_and_packed_as_a_source_of_the_mix(tmp_path: pathlib.Path) -> None:
    calls = run_stage("prompts", tmp_path, SELF_PROMPTS="300", SELF_PROMPT_EXTRA="--top-p 0.95", MIX="sharegpt=10",
                      DECODE_ROWS="96")
    self_prompt = [c.split() for c in calls if "self-prompt" in c]
    assert len(self_prompt) == 1
    written = str(tmp_path / "run" / "self_prompts.jsonl")
    args = self_prompt[0]
    assert args[args.index("--num-prompts") + 1] == "300" and args[args.index("--out") + 1] == written
    assert args[args.index("--decode-rows") + 1] == "96"  # as many rows in flight as regeneration
    assert args[-2:] == ["--top-p", "0.95"]
    pack = [c.split() for c in calls if "dflash_train.prompts.pack" in c][0]
    assert [pack[i + 1] for i, a in enumerate(pack) if a == "--source"] == ["sharegpt=10", f"{written}=300"]
    (tmp_path / "run" / "self_prompts.jsonl").write_text("")  # an earlier call's: not written again
    again = run_stage("prompts", tmp_path, SELF_PROMPTS="300", MIX="sharegpt=10")
    assert not [c for c in again if "self-prompt" in c] and [c for c in again if "dflash_train.prompts.pack" in c]
    assert not [c for c in run_stage("prompts", tmp_path, SELF_PROMPTS="0", MIX="sharegpt=10") if "self-prompt" in c]
    (tmp_path / "run" / "prompts.jsonl").unlink(missing_ok=True)
    (tmp_path / "run" / "self_prompts.jsonl").unlink()
    default = [c.split() for c in run_stage("prompts", tmp_path, MIX="sharegpt=10") if "self-prompt" in c]
    assert [args[args.index("--num-prompts") + 1] for args in default] == ["75000"]  # the default mix has them
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prompts"], cwd=REPO,
                          env={**os.environ, "OUT": str(tmp_path / "bad"), "SELF_PROMPTS": "many"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SELF_PROMPTS must be a count of prompts (0 for none), not 'many'" in done.stderr


def test_each_ablation_is_trained_then_evaluated_and_compared_with_its_decoded_tau(tmp_path: pathlib.Path) -> None:
    calls = run_stage("ablate", tmp_path, ABLATIONS="soft:training.soft_targets=true;lr2x:a=1 b=2",
                      ABLATION_EVAL_PROMPTS="12", ABLATION_DATA="")
    steps = [("train" if "cli train" in c else "eval" if "cli eval" in c else "compare" if "compare" in c else None, c)
             for c in calls]
    steps = [(kind, c.split()) for kind, c in steps if kind]
    assert [kind for kind, _ in steps] == ["train", "eval"] * 3 + ["compare"]  # at 0 alone by default
    outs = [args[args.index("--out") + 1].rsplit("/", 1)[-1] for kind, args in steps if kind == "eval"]
    assert outs == ["ablation-base-b16.json", "ablation-soft-b16.json", "ablation-lr2x-b16.json"]
    assert all(args[args.index("--num-prompts") + 1] == "12" and "--no-lossless-check" in args
               and args[args.index("--target-cache") + 1] == str(tmp_path / "run" / "eval" / "target-cache")
               and "--no-teacher-forced" in args for kind, args in steps if kind == "eval")
    assert "a=1" in steps[4][1] and "b=2" in steps[4][1]  # an entry's overrides, split into words
    compare = steps[-1][1]
    assert compare[compare.index("--evals") + 1] == str(tmp_path / "run" / "eval")
    none = run_stage("ablate", tmp_path, ABLATIONS="soft:training.soft_targets=true", ABLATION_EVAL_PROMPTS="0",
                     ABLATION_DATA="")
    assert not [c for c in none if "cli eval" in c]
    only_base = [c for c in run_stage("ablate", tmp_path, ABLATIONS="", ABLATION_DATA="") if "cli train" in c]
    assert len(only_base) == 1 and "training.output_dir=" + str(tmp_path / "run" / "train" / "ablation-base") in only_base[0]


def test_curve_and_ablate_prepare_answers_a_stopped_call_left_unprepared(tmp_path: pathlib.Path) -> None:
    def first_steps(stage: str, **settings: str) -> list[str]:
        calls = run_stage(stage, tmp_path, ABLATIONS="", ABLATION_DATA="", CURVE_MINUTES="5", **settings)
        return [c.split()[2] for c in calls if c.startswith("-m dflash_train.cli ")][:2]

    assert first_steps("ablate") == ["train", "eval"]  # no answers: nothing to prepare (training says what to run)
    (tmp_path / "run" / "regen").mkdir(parents=True)
    assert first_steps("ablate") == ["prepare", "train"]
    assert first_steps("curve") == ["prepare", "train"]
    (tmp_path / "run" / "prepared").mkdir()
    (tmp_path / "run" / "prepared" / "dflash_data.json").write_text("{}")
    assert first_steps("curve") == ["train", "eval"]


def test_data_variants_are_prepared_once_from_the_same_answers_and_trained_on(tmp_path: pathlib.Path) -> None:
    """ABLATION_DATA: the regenerated answers prepared again with other flags; a run of the baseline recipe on
    each, after the recipe ablations; the 512-token, no-self-prompts and trim-loops variants are there by default, and a
    variant's flags come after the stage's own (its --max-length wins over MAX_LENGTH)."""
    run = tmp_path / "run"
    calls = [c.split() for c in run_stage("ablate", tmp_path, ABLATIONS="lr2x:a=1")]
    prepares = [args for args in calls if "prepare" in args]
    assert len(prepares) == 3 and "--trim-loops" in prepares[2]
    assert prepares[2][prepares[2].index("--out") + 1] == str(run / "prepared-trim_loops")
    assert prepares[2][prepares[2].index("--data") + 1] == str(run / "regen")
    lengths = [prepares[0][i + 1] for i, arg in enumerate(prepares[0]) if arg == "--max-length"]
    assert lengths[-1] == "512" and len(lengths) == 2  # argparse keeps the last
    trains = [args for args in calls if "train" in args and "cli" in " ".join(args)]
    assert [args[[a.startswith("training.output_dir=") for a in args].index(True)].rsplit("/", 1)[-1]
            for args in trains] == ["ablation-base", "ablation-lr2x", "ablation-maxlen512", "ablation-noself",
                                    "ablation-trim_loops"]
    last = trains[4]
    data = [a for a in last if a.startswith("data.prepared=")]
    assert data[-1] == f"data.prepared={run}/prepared-trim_loops"  # the later override wins
    (run / "prepared-trim_loops").mkdir()
    (run / "prepared-trim_loops" / "dflash_data.json").write_text("{}")  # prepared: not again
    again = [c.split() for c in run_stage("ablate", tmp_path, ABLATIONS="lr2x:a=1",
                                          ABLATION_DATA="trim_loops:--trim-loops;last:--train-turns last")]
    prepares = [args for args in again if "prepare" in args]
    assert len(prepares) == 1 and prepares[0][prepares[0].index("--out") + 1] == str(run / "prepared-last")
    assert prepares[0][prepares[0].index("--train-turns") + 1] == "last"  # an entry's flags, split into words


def test_self_math_prompts_ask_for_worked_solutions_and_join_the_mix_under_their_label(tmp_path: pathlib.Path) -> None:
    calls = run_stage("prompts", tmp_path, SELF_PROMPTS="0", SELF_MATH_PROMPTS="50", MIX="sharegpt=10")
    (args,) = [c.split(" --") for c in calls if "self-prompt" in c]
    flags = {flag.split(" ", 1)[0]: flag.split(" ", 1)[1] if " " in flag else "" for flag in args[1:]}
    written = str(tmp_path / "run" / "self_prompts-math.jsonl")
    assert (flags["num-prompts"], flags["label"], flags["out"]) == ("50", "math", written)
    assert flags["opening"] == "Here is a math word problem for you to solve:"
    assert flags["request"] == "Solve it step by step, then give the final answer in \\boxed{}."
    pack = [c.split() for c in calls if "dflash_train.prompts.pack" in c][0]
    assert [pack[i + 1] for i, a in enumerate(pack) if a == "--source"] == ["sharegpt=10", f"{written}=50"]
    assert not [c for c in run_stage("prompts", tmp_path, SELF_PROMPTS="0", MIX="sharegpt=10") if "self-prompt" in c]


def test_self_prompting_minutes_come_off_the_regeneration_budget(tmp_path: pathlib.Path) -> None:
    """REGEN_MINUTES is the target's data budget: seconds spent writing self-prompts shorten regeneration."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "timeout").write_text(TIMEOUT_SHIM)
    (bin_dir / "timeout").chmod(0o755)
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="5") if c.startswith("timeout")] == [
        "timeout 300s"]
    (tmp_path / "run" / "self_prompts.seconds").write_text("75\n")
    forget_regeneration(tmp_path)
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="5") if c.startswith("timeout")] == [
        "timeout 225s"]
    (tmp_path / "run" / "self_prompts-math.seconds").write_text("45\n")  # every self-prompt set is paid for
    forget_regeneration(tmp_path)
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="5") if c.startswith("timeout")] == [
        "timeout 180s"]
    (tmp_path / "run" / "self_prompts.seconds").write_text("500\n")  # never below a minute
    forget_regeneration(tmp_path)
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="2.5") if c.startswith("timeout")] == [
        "timeout 60s"]


def test_a_stage_a_call_limit_kills_still_counts_and_regeneration_resumes_with_what_is_left(
        tmp_path: pathlib.Path) -> None:
    """A time-limited machine kills the regeneration mid-way: its seconds so far are kept and folded into
    times.tsv by the next call, whose regeneration gets only what REGEN_MINUTES has left."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(SLOW_REGEN_SHIM)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "run"), "CALLS": str(calls), "DRAFT": str(tmp_path / "draft"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REGEN_MINUTES": "5"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "prompts.jsonl").touch()
    cut = subprocess.run(["timeout", "8", "bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "regenerate"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert cut.returncode == 124
    name, seconds = (tmp_path / "run" / "times.open").read_text().split()
    assert name == "regenerate" and 5 <= int(seconds) <= 8
    (bin_dir / "timeout").write_text(TIMEOUT_SHIM)
    (bin_dir / "timeout").chmod(0o755)
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="5") if c.startswith("timeout")] == [
        f"timeout {300 - int(seconds)}s"]
    assert not (tmp_path / "run" / "times.open").exists()
    rows = [line.split("\t")[0] for line in (tmp_path / "run" / "times.tsv").read_text().splitlines()]
    assert rows == ["regenerate", "regenerate"]  # the cut attempt, then the finished one


def test_a_finished_regeneration_is_not_run_again_nor_taken_for_a_cut_one(tmp_path: pathlib.Path) -> None:
    assert [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="1") if "cli regenerate" in c]
    assert (tmp_path / "run" / "regen.done").exists()
    assert (tmp_path / "run" / "times.tsv").read_text().startswith("regenerate\t")  # its row, over the budget
    (tmp_path / "run" / "times.tsv").write_text("regenerate\t600\n")
    assert not [c for c in run_stage("regenerate", tmp_path, REGEN_MINUTES="1") if "cli regenerate" in c]
    assert not (tmp_path / "run" / "regen.budget-spent").exists()  # prepare will not take it for unfinished


def test_regeneration_spent_by_cut_calls_goes_straight_to_prepare(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "self_prompts.seconds").write_text("100\n")
    (tmp_path / "run" / "times.tsv").write_text("prompts\t110\nregenerate\t150\n")
    (tmp_path / "run" / "times.open").write_text("regenerate\t50\n")  # 100 + 150 + 50 = the 5 minutes
    calls = run_stage("regenerate", tmp_path, REGEN_MINUTES="5")
    assert not [c for c in calls if "regenerate" in c]
    assert (tmp_path / "run" / "regen.budget-spent").exists()


def test_trim_loops_reaches_prepare(tmp_path: pathlib.Path) -> None:
    prepare = [c.split() for c in run_stage("prepare", tmp_path, TRIM_LOOPS="1") if "cli prepare" in c]
    assert len(prepare) == 1 and "--trim-loops" in prepare[0]
    prepare = [c.split() for c in run_stage("prepare", tmp_path) if "cli prepare" in c]
    assert len(prepare) == 1 and "--trim-loops" not in prepare[0]
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prepare"], cwd=REPO,
                          env={**os.environ, "OUT": str(tmp_path / "bad"), "TRIM_LOOPS": "yes"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TRIM_LOOPS must be 0 or 1, not 'yes'" in done.stderr


def test_stop_loops_reaches_every_regeneration(tmp_path: pathlib.Path) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("")
    regen = [c.split() for c in run_stage("regenerate", tmp_path, STOP_LOOPS="1", CHATS=f"{chats}=1")
             if "cli regenerate" in c]
    assert len(regen) == 2 and all("--stop-loops" in args for args in regen)  # whole chats, then prompts
    forget_regeneration(tmp_path)
    regen = [c.split() for c in run_stage("regenerate", tmp_path) if "cli regenerate" in c]
    assert regen and all("--stop-loops" in args for args in regen)  # on by default
    forget_regeneration(tmp_path)
    regen = [c.split() for c in run_stage("regenerate", tmp_path, STOP_LOOPS="0") if "cli regenerate" in c]
    assert regen and not any("--stop-loops" in args for args in regen)
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "regenerate"], cwd=REPO,
                          env={**os.environ, "OUT": str(tmp_path / "bad"), "STOP_LOOPS": "on"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "STOP_LOOPS must be 0 or 1, not 'on'" in done.stderr


def test_every_default_ablation_is_a_valid_change_of_the_recipe(tmp_path: pathlib.Path) -> None:
    """The ablate stage's default runs, as the script hands them to training, load as overrides of the packed
    recipe and change what they name (a typo would only show on the GPU, after the baseline's minutes)."""
    from dflash_train.training.config import load_config

    calls = [c.split() for c in run_stage("ablate", tmp_path, ABLATION_DATA="") if "dflash_train.cli train" in c]
    names = [next(a for a in args if a.startswith("training.output_dir=")).rsplit("/", 1)[-1] for args in calls]
    assert names == ["ablation-base", "ablation-anchors16", "ablation-lr2x"]
    recipe = REPO / "recipes/smollm2-135m-dflash-b16-packed.yaml"
    base = load_config(recipe)
    for name, args in zip(names, calls, strict=True):
        assert args[args.index("--config") + 1] == "recipes/smollm2-135m-dflash-b16-packed.yaml"
        overrides = [a for a in args[args.index("--config") + 2 :] if "=" in a and not a.startswith(
            ("model.target=", "data.prepared=", "training.output_dir="))]
        config = load_config(recipe, overrides)
        def knobs(c: object) -> tuple[object, ...]:
            return (c.training.learning_rate, c.training.muon_learning_rate, c.training.num_anchors)

        changed = {"ablation-base": knobs(config) == knobs(base),
                   "ablation-anchors16": config.training.num_anchors == 16 == base.training.num_anchors // 2,
                   "ablation-lr2x": (config.training.learning_rate, config.training.muon_learning_rate) == (
                       2 * base.training.learning_rate, 2 * base.training.muon_learning_rate)}[name]
        assert changed, name


def test_every_default_data_ablation_is_a_valid_prepare_call(tmp_path: pathlib.Path) -> None:
    """The ablate stage's default data variants prepare the same answers again with their own flags: each one
    must reach prepare, after the stage's own flags, as arguments prepare's parser accepts."""
    import argparse

    from dflash_train.commands import prepare

    calls = [c.split() for c in run_stage("ablate", tmp_path, ABLATIONS="") if "cli prepare" in c]
    outs = {args[args.index("--out") + 1].rsplit("/", 1)[-1]: args for args in calls}
    assert {"prepared-trim_loops", "prepared-maxlen512", "prepared-noself"} <= set(outs)
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    for out, args in outs.items():
        parsed = parser.parse_args(args[args.index("prepare") + 1 :])
        changed = {"prepared-trim_loops": parsed.trim_loops, "prepared-maxlen512": parsed.max_length == 512,
                   "prepared-noself": parsed.exclude_source == ["self-prompts"]}.get(out, True)
        assert changed, out


def test_summary_checks_the_goals(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "times.tsv").write_text("train\t540\n")
    summary = [c.split() for c in run_stage("summary", tmp_path) if "recipes.scoring.summary" in c]
    assert summary == [["-m", "recipes.scoring.summary", str(tmp_path / "run"), "--goal", "humaneval=4.5",
                        "--goal", "mt-bench=4.5", "--goal", "math-synthetic=5.5", "--goal", "speedup=2.5",
                        "--goal", "chats=150000", "--goal", "minutes=25", "--goal", "mfu=30"]]
    summary = [c.split() for c in run_stage("summary", tmp_path, GOALS="") if "recipes.scoring.summary" in c]
    assert summary == [["-m", "recipes.scoring.summary", str(tmp_path / "run")]]


def test_the_summary_sums_a_stage_run_in_parts(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "times.tsv").write_text(
        "prompts\t120\nprepare\t40\nablate\t600\nprepare\t50\ntrain\t480\ntrain\t120\n")
    env = {**os.environ, "OUT": str(tmp_path / "run"), "GOALS": "", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    (tmp_path / "python3").write_text("#!/usr/bin/env bash\nexit 0\n")
    (tmp_path / "python3").chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "summary"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [line.split() for line in done.stdout.splitlines()[1:]] == [
        ["prompts", "2.0"], ["prepare", "1.5", "(2", "parts)"], ["ablate", "10.0"], ["train", "10.0", "(2", "parts)"],
        ["total", "13.5"]]  # the ablate stage's runs are extra
    assert not list(REPO.glob("*parts)*"))  # awk's `>` inside printf would have written a file of that name


def budgets(calls: list[str]) -> list[str]:
    return [a for c in calls if "dflash_train.cli train" in c for a in c.split() if a.startswith("training.time_budget")]


def test_training_gets_what_the_total_leaves_once(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    times = tmp_path / "run" / "times.tsv"
    times.write_text("prompts\t174\nregenerate\t354\nprepare\t48\ncurve\t900\n")  # 9.6 data minutes; curve is extra
    # 24 - 9.6 - 5 = 9.40 minutes; kept, so a resumed call trains to the same schedule after more stages ran
    assert budgets(run_stage("train", tmp_path, TOTAL_MINUTES="24", EVAL_RESERVE_MINUTES="5")) == [
        "training.time_budget_minutes=9.40"]
    times.write_text(times.read_text() + "train\t500\n")
    assert budgets(run_stage("train", tmp_path)) == ["training.time_budget_minutes=9.40"]
    assert budgets(run_stage("train", tmp_path, TRAIN_MINUTES="3")) == ["training.time_budget_minutes=3"]


def test_a_total_too_small_for_training_is_a_one_line_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "times.tsv").write_text("prompts\t300\nregenerate\t600\n")
    env = {**os.environ, "OUT": str(tmp_path / "run"), "TOTAL_MINUTES": "19"}
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "train"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not (tmp_path / "run" / "train_minutes").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "TOTAL_MINUTES=19 leaves -1.00 training minutes after 15 minutes of data and EVAL_RESERVE_MINUTES=5: "
        "raise TOTAL_MINUTES, lower REGEN_MINUTES or set TRAIN_MINUTES")
    bad = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "train"], cwd=REPO,
                         env={**env, "TOTAL_MINUTES": "soon"}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "TOTAL_MINUTES must be a number of minutes, not 'soon'"


def test_a_malformed_goal_stops_the_run_before_it_starts(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "run"), "GOALS": "mt-bench=4 speedup"}
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prompts"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        "GOALS entry 'speedup' is not KEY=NUMBER (e.g. mt-bench=4.0 speedup=2 chats=150000 minutes=25)")


def test_the_ablation_table_is_kept_beside_its_plot(tmp_path: pathlib.Path) -> None:
    """The compare table the ablate stage prints is written to $OUT/ablations.md as well (the stand-in python3
    prints each call's arguments to stdout here, so the file holds the compare call's)."""
    shim = SHIM.replace("exit 0", 'echo "$*"\nexit 0')
    calls = run_stage("ablate", tmp_path, shim=shim, ABLATIONS="", ABLATION_DATA="", ABLATION_TEMPERATURES="0")
    compare = next(c for c in calls if "recipes.scoring.compare" in c)
    assert (tmp_path / "run" / "ablations.md").read_text().strip() == compare
    # A sweep's other temperatures follow, each under its own line, after the lowest's table and its plot.
    calls = run_stage("ablate", tmp_path, shim=shim, ABLATIONS="", ABLATION_DATA="", ABLATION_TEMPERATURES="0,1,0.7")
    compares = [c for c in calls if "recipes.scoring.compare" in c]
    assert (tmp_path / "run" / "ablations.md").read_text().strip().split("\n\n") == [
        compares[0], f"decoded τ at temperature 0.7:\n{compares[1]}", f"decoded τ at temperature 1:\n{compares[2]}"]


def test_main_runs_validate_less_often_than_ablations(tmp_path: pathlib.Path) -> None:
    """Validation and checkpoints every CHECK_EVERY steps (1000) in the main run, every ABLATION_CHECK_EVERY (400)
    in the ablate stage's short runs, whose held-out τ̂ curves need the points."""
    def every(calls: list[str]) -> set[tuple[str, ...]]:
        return {tuple(a for a in c.split() if a.startswith(("training.eval_every=", "training.save_every=")))
                for c in calls if "dflash_train.cli train" in c}

    assert every(run_stage("train", tmp_path)) == {("training.save_every=1000", "training.eval_every=1000")}
    assert every(run_stage("ablate", tmp_path, ABLATION_DATA="")) == {
        ("training.save_every=400", "training.eval_every=400")}
    assert every(run_stage("train", tmp_path, CHECK_EVERY="250")) == {
        ("training.save_every=250", "training.eval_every=250")}


def test_the_main_eval_sweeps_the_temperatures_it_is_given(tmp_path: pathlib.Path) -> None:
    """EVAL_TEMPERATURES=0,0.7,1: the bf16 batch-1 eval decodes the same prompts at each in one sweep; by default
    it runs at 0 alone (the run's clock). The batch-8 and float32 checks and the curve's points stay at 0 (no
    --temperature: its default)."""
    def temperatures(calls: list[str]) -> list[str | None]:
        evals = [c.split() for c in calls if "dflash_train.cli eval" in c]
        return [args[args.index("--temperature") + 1] if "--temperature" in args else None for args in evals]

    calls = run_stage("eval", tmp_path, FINISHED="1", EVAL_TEMPERATURES="0,0.7,1")
    main = [c.split() for c in calls if "dflash_train.cli eval" in c and "main-b16.json" in c]
    assert len(main) == 1 and main[0][main[0].index("--temperature") + 1] == "0,0.7,1"
    assert temperatures(calls) == ["0,0.7,1", None, None]  # then batch 8, then float32
    (tmp_path / "run" / "eval").mkdir(exist_ok=True)
    for report in ("main-b16.json", "main-b8.json", "main-fp32.json"):
        (tmp_path / "run" / "eval" / report).unlink(missing_ok=True)
    assert temperatures(run_stage("eval", tmp_path, FINISHED="1")) == ["0", None, None]
    assert temperatures(run_stage("curve", tmp_path, CURVE_MINUTES="5", ABLATION_DATA="")) == [None]


def test_a_bad_temperature_list_stops_the_run_before_it_starts(tmp_path: pathlib.Path) -> None:
    for settings, message in (
            ({"EVAL_TEMPERATURES": "0.7,1"}, "EVAL_TEMPERATURES must include 0 (the run's own figures and its exact "
                                             "check), not '0.7,1'"),
            ({"EVAL_TEMPERATURES": "0,hot"}, "EVAL_TEMPERATURES must be a comma list of temperatures (e.g. 0,0.7,1 "
                                             "or 0), not '0,hot'"),
            ({"ABLATION_TEMPERATURES": "0 1"}, "ABLATION_TEMPERATURES must be a comma list of temperatures (e.g. "
                                               "0,0.7,1 or 0), not '0 1'")):
        done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prompts"], cwd=REPO,
                              env={**os.environ, "OUT": str(tmp_path / "run"), **settings},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.strip() == message


def test_ablation_evals_sweep_their_temperatures_and_are_compared_at_each(tmp_path: pathlib.Path) -> None:
    calls = run_stage("ablate", tmp_path, ABLATIONS="lr2x:a=1", ABLATION_DATA="", ABLATION_EVAL_PROMPTS="12",
                      ABLATION_TEMPERATURES="0,0.7,1")
    evals = [c.split() for c in calls if "dflash_train.cli eval" in c]
    assert len(evals) == 2 and all(args[args.index("--temperature") + 1] == "0,0.7,1" for args in evals)
    compares = [c.split() for c in calls if "recipes.scoring.compare" in c]
    assert [args[args.index("--temperature") + 1] if "--temperature" in args else None for args in compares] == [
        None, "0.7", "1"]  # the lowest is the reports' own figures
    assert "--plot" in compares[0] and all("--plot" not in args and "--evals" in args for args in compares[1:])
    calls = run_stage("ablate", tmp_path, ABLATIONS="", ABLATION_DATA="", EVAL_TEMPERATURES="0,1",
                      ABLATION_TEMPERATURES="0", ABLATION_EVAL_PROMPTS="12")
    (base,) = [c.split() for c in calls if "cli eval" in c]
    assert base[base.index("--temperature") + 1] == "0"  # its own setting, not EVAL_TEMPERATURES
    assert len([c for c in calls if "recipes.scoring.compare" in c]) == 1
    calls = run_stage("ablate", tmp_path, ABLATIONS="", ABLATION_DATA="", ABLATION_EVAL_PROMPTS="0")
    assert len([c for c in calls if "recipes.scoring.compare" in c]) == 1  # no decoded τ: no table per temperature


def test_an_ablation_of_the_objective_at_a_temperature_reaches_the_training_config(tmp_path: pathlib.Path) -> None:
    """ABLATIONS takes the loss keys like any other: the kl07 run trains with the KL at 0.7, half distillation,
    the ce run (the control of the recipe's KL at 1) with the label's cross-entropy alone."""
    from dflash_train.training.config import load_config

    calls = run_stage("ablate", tmp_path, ABLATION_DATA="", ABLATION_EVAL_PROMPTS="0",
                      ABLATIONS="kl07:training.loss=kl training.loss_temperature=0.7 training.distill_weight=0.5;"
                                "ce:training.loss=ce")
    trains = {next(a for a in args if a.startswith("training.output_dir=")).rsplit("/", 1)[-1]: args
              for args in (c.split() for c in calls if "dflash_train.cli train" in c)}
    assert list(trains) == ["ablation-base", "ablation-kl07", "ablation-ce"]
    recipe = REPO / "recipes/smollm2-135m-dflash-b16-packed.yaml"
    configs = {name: load_config(recipe, [a for a in args[args.index("--config") + 2:] if "=" in a])
               for name, args in trains.items()}
    trained = configs["ablation-kl07"].training
    assert (trained.loss, trained.loss_temperature, trained.distill_weight) == ("kl", 0.7, 0.5)
    base = configs["ablation-base"].training
    assert (base.loss, base.loss_temperature, base.distill_weight) == ("kl", 1.0, 1.0)
    assert configs["ablation-ce"].training.loss == "ce" and not configs["ablation-ce"].training.reads_target_distribution


def test_answer_variants_are_regenerated_prepared_and_trained_on_at_equal_minutes(tmp_path: pathlib.Path) -> None:
    """ABLATION_REGEN: the same prompts answered again with other regenerate flags (two sampled answers instead of
    the greedy one), for REGEN_MINUTES unless ABLATION_REGEN_MINUTES says otherwise, into their own folder; prepared
    from there and trained on by the baseline recipe; a finished variant is not regenerated again."""
    run, bin_dir = tmp_path / "run", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "timeout").write_text(TIMEOUT_SHIM)
    (bin_dir / "timeout").chmod(0o755)
    settings = dict(ABLATIONS="", ABLATION_DATA="", ABLATION_EVAL_PROMPTS="0", REGEN_MINUTES="2.5",
                    ABLATION_REGEN="sampled:--samples-per-prompt 2 --temperature 0.7")
    calls = [c.split() for c in run_stage("ablate", tmp_path, **settings)]
    assert [c for c in calls if c[0] == "timeout"] == [["timeout", "150s"]]  # the base data's minutes
    regens = [args for args in calls if "regenerate" in args]
    assert len(regens) == 1 and regens[0][regens[0].index("--out") + 1] == str(run / "regen-sampled")
    assert regens[0][regens[0].index("--samples-per-prompt") + 1] == "2"
    assert regens[0][regens[0].index("--data") + 1] == str(run / "prompts.jsonl")
    prepares = [args for args in calls if "prepare" in args]
    assert [p[p.index("--data") + 1] for p in prepares] == [str(run / "regen-sampled")]
    assert prepares[0][prepares[0].index("--out") + 1] == str(run / "prepared-sampled")
    trains = [args for args in calls if "train" in args and "cli" in " ".join(args)]
    assert [next(a for a in t if a.startswith("training.output_dir=")).rsplit("/", 1)[-1] for t in trains] == [
        "ablation-base", "ablation-sampled"]
    assert [a for a in trains[1] if a.startswith("data.prepared=")][-1] == f"data.prepared={run}/prepared-sampled"
    assert (run / "regen-sampled.done").exists()
    again = run_stage("ablate", tmp_path, **settings)
    assert not [c for c in again if " regenerate " in f" {c} "]
    (run / "regen-sampled.done").unlink()
    shorter = run_stage("ablate", tmp_path, **settings, ABLATION_REGEN_MINUTES="1")
    assert [c for c in shorter if c.startswith("timeout")] == ["timeout 60s"]


def test_an_answer_variant_named_with_a_plus_is_prepared_beside_the_greedy_answers(tmp_path: pathlib.Path) -> None:
    """"mixed+:flags": the variant's answers and the stage's own greedy ones prepared together into
    prepared-mixed (run ablation-mixed), the variant regenerated for ABLATION_REGEN_MINUTES on top."""
    run, bin_dir = tmp_path / "run", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "timeout").write_text(TIMEOUT_SHIM)
    (bin_dir / "timeout").chmod(0o755)
    calls = [c.split() for c in run_stage("ablate", tmp_path, ABLATIONS="", ABLATION_DATA="", ABLATION_EVAL_PROMPTS="0",
                                          REGEN_MINUTES="2.5", ABLATION_REGEN_MINUTES="1.25",
                                          ABLATION_REGEN="mixed+:--temperature 1.0")]
    assert [c for c in calls if c[0] == "timeout"] == [["timeout", "75s"]]
    regens = [args for args in calls if "regenerate" in args]
    assert len(regens) == 1 and regens[0][regens[0].index("--out") + 1] == str(run / "regen-mixed")
    prepares = [args for args in calls if "prepare" in args]
    assert [[p[i + 1] for i, a in enumerate(p) if a == "--data"] for p in prepares] == [
        [str(run / "regen"), str(run / "regen-mixed")]]
    assert prepares[0][prepares[0].index("--out") + 1] == str(run / "prepared-mixed")
    trains = [args for args in calls if "train" in args and "cli" in " ".join(args)]
    assert [a for a in trains[1] if a.startswith("data.prepared=")][-1] == f"data.prepared={run}/prepared-mixed"
    assert any(a.endswith("/ablation-mixed") for a in trains[1])


@pytest.mark.parametrize("gpus", ["1", "2", "3"])
def test_with_gpus_the_evals_run_side_by_side_the_headline_alone_on_gpu_0(tmp_path: pathlib.Path, gpus: str) -> None:
    """One GPU: the headline, batch-8 and float32 evals one after another. Two: the headline alone on GPU 0 (its
    speedup is timed), batch 8 then float32 on GPU 1. Three or more: one eval a GPU. Export and check follow."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    calls = run_stage("eval", tmp_path, shim=RANK_SHIM, GPUS=gpus, EVAL_DRAFT=str(draft))
    evals = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c.split()[0] for c in calls if " eval " in c}
    expected = {"1": ["none"] * 3, "2": ["0", "1", "1"], "3": ["0", "1", "2"]}[gpus]
    assert evals == {name: f"LOCAL_RANK={rank}" for name, rank in
                     zip(["main-b16.json", "main-b8.json", "main-fp32.json"], expected, strict=True)}
    order = [c.split()[3] for c in calls if " dflash_train.cli " in c]
    assert order[-2:] == ["export", "check"]
    if gpus == "2":  # on GPU 1, float32 after batch 8
        gpu1 = [c for c in calls if c.startswith("LOCAL_RANK=1 ")]
        assert ["main-b8.json" in gpu1[0], "main-fp32.json" in gpu1[1]] == [True, True]


def test_with_gpus_self_prompts_are_written_one_rank_a_gpu_each_file_a_source(tmp_path: pathlib.Path) -> None:
    """GPUS=2: two self-prompt ranks (LOCAL_RANK picks the GPU), each its share into a file of its own, and the
    pack takes both files with their shares (151 + 150 of 301); once both files are there, none is written again."""
    calls = run_stage("prompts", tmp_path, shim=RANK_SHIM, GPUS="2", SELF_PROMPTS="301", MIX="sharegpt=10")
    ranks = sorted(c.split() for c in calls if " self-prompt " in c)
    assert [(c[0], c[c.index("--rank") + 1], c[c.index("--world-size") + 1]) for c in ranks] == [
        ("LOCAL_RANK=0", "0", "2"), ("LOCAL_RANK=1", "1", "2")]
    assert all(c[c.index("--num-prompts") + 1] == "301" and "--overwrite" in c for c in ranks)
    run = tmp_path / "run"
    files = [str(run / f"self_prompts.rank{rank}-of2.jsonl") for rank in (0, 1)]
    pack = [c.split() for c in calls if "dflash_train.prompts.pack" in c][0]
    assert [pack[i + 1] for i, a in enumerate(pack) if a == "--source"] == [
        "sharegpt=10", f"{files[0]}=151", f"{files[1]}=150"]
    assert (run / "self_prompts.seconds").is_file()
    for file in files:
        pathlib.Path(file).write_text("")
    (run / "prompts.jsonl").unlink(missing_ok=True)
    again = run_stage("prompts", tmp_path, shim=RANK_SHIM, GPUS="2", SELF_PROMPTS="301", MIX="sharegpt=10")
    assert not [c for c in again if " self-prompt " in c] and [c for c in again if "dflash_train.prompts.pack" in c]
    # fewer prompts than GPUs: one process writes them all
    (run / "prompts.jsonl").unlink(missing_ok=True)
    few = run_stage("prompts", tmp_path, shim=RANK_SHIM, GPUS="2", SELF_PROMPTS="0", SELF_MATH_PROMPTS="1",
                    MIX="sharegpt=10")
    (math,) = [c.split() for c in few if " self-prompt " in c]
    assert "--rank" not in math and math[math.index("--out") + 1] == str(run / "self_prompts-math.jsonl")


def test_data_scale_multiplies_every_prompt_count(tmp_path: pathlib.Path) -> None:
    """DATA_SCALE=2.5: the mix's counts (a file's too, after its last =) and the self-prompts', rounded; a source
    without a count is left as it is. A scale that is no number above 0 is one line before anything runs."""
    mix = f"sharegpt=10 {tmp_path / 'a=b.jsonl'}=3 code-prompts"
    calls = run_stage("prompts", tmp_path, DATA_SCALE="2.5", SELF_PROMPTS="300", MIX=mix)
    (self_prompt,) = [c.split() for c in calls if " self-prompt " in c]
    assert self_prompt[self_prompt.index("--num-prompts") + 1] == "750"
    pack = [c.split() for c in calls if "dflash_train.prompts.pack" in c][0]
    assert [pack[i + 1] for i, a in enumerate(pack) if a == "--source"] == [
        "sharegpt=25", f"{tmp_path / 'a=b.jsonl'}=8", "code-prompts", f"{tmp_path / 'run' / 'self_prompts.jsonl'}=750"]
    for bad in ("0", "two", "-1"):
        done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), "prompts"], cwd=REPO,
                              env={**os.environ, "OUT": str(tmp_path / "bad"), "DATA_SCALE": bad},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1
        assert f"DATA_SCALE must be a number above 0 (what the prompt counts are multiplied by), not '{bad}'" in done.stderr
