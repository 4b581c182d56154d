"""`recipes/smollm2-135m-speedrun.sh all` end to end at toy sizes on the real SmolLM2 (CPU): pack prompts,
regenerate, prepare, packed training, the three eval sets, the float32 lossless check, export, check, and the
table of minutes per stage; then a second `all` skips every finished stage."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.markers import needs_smollm2
from tests.helpers.paths import REPO

TOY = {"MIX": f"{REPO / 'data/prompts/demo_prompts.jsonl'}=8", "SELF_PROMPTS": "0", "MAX_NEW_TOKENS": "48", "MAX_LENGTH": "256",
       "DECODE_ROWS": "4", "TRAIN_MINUTES": "0.3", "EVAL_PROMPTS": "1", "FP32_PROMPTS": "1", "BATCH8_PROMPTS": "2",
       "EVAL_NEW_TOKENS": "24", "EVAL_TEMPERATURES": "0,0.7,1", "ABLATION_TEMPERATURES": "0,0.7,1",
       "TRAIN_EXTRA": "training.compile=false training.compile_target=false training.mixed_precision=no "
                      "model.target_dtype=float32 "
                      "data.validation_fraction=0.25 data.max_length=256 data.pack_tokens=512 training.batch_size=1 "
                      "training.num_anchors=8"}


def speedrun(stage: str, out: pathlib.Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **TOY, **settings, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), stage], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
@needs_smollm2
def test_speedrun_runs_every_stage_and_skips_finished_ones(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    first = speedrun("all", out)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    stages = [line.split("\t")[0] for line in (out / "times.tsv").read_text().splitlines()]
    assert stages == ["prompts", "regenerate", "prepare", "train", "eval"]
    rows = json.loads((out / "summary.json").read_text())
    datasets = {(row["dataset"], row["dtype"]) for row in rows}
    assert {("humaneval", "float32"), ("mt-bench", "float32"), ("math-synthetic", "float32")} <= datasets
    assert all(row["lossless"] == "yes" for row in rows)
    # The batch-8 pass: its 8 rows are cut to the 2 conversations a set has here.
    assert {(row["dataset"], row["batch"]) for row in rows if row["report"].endswith("main-b8.json")} == {
        ("mt-bench", 2), ("humaneval", 2)}
    # The bf16 batch-1 eval is one sweep over 0, 0.7 and 1; its own figures (the table's τ) are those at 0.
    swept = [row for row in rows if row["report"].endswith("main-b16.json")]
    assert swept and all([p["temperature"] for p in row["temperature_sweep"]] == [0.0, 0.7, 1.0] for row in swept)
    assert all(row["temperature_sweep"] is None for row in rows if not row["report"].endswith("main-b16.json"))
    assert (out / "export" / "config.json").is_file()
    assert "total" in first.stdout
    again = speedrun("all", out)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "dflash_train.cli regenerate" not in again.stderr and "dflash_train.cli eval" not in again.stderr
    curve = speedrun("curve", out, CURVE_MINUTES="0.2 0.3")
    assert curve.returncode == 0, (curve.stdout + curve.stderr)[-4000:]
    points = json.loads((out / "curve.json").read_text())
    assert {p["run"] for p in points} == {"curve-0.2min", "curve-0.3min", "main"}
    assert {p["dataset"] for p in points} == {"humaneval", "mt-bench", "math-synthetic"}
    assert [p["train_minutes"] for p in points] == sorted(p["train_minutes"] for p in points)
    ablate = speedrun("ablate", out, ABLATIONS="anchors4:training.num_anchors=4", ABLATION_MINUTES="0.2",
                      ABLATION_EVAL_PROMPTS="1", ABLATION_DATA="trim_loops:--trim-loops")
    assert ablate.returncode == 0, (ablate.stdout + ablate.stderr)[-4000:]
    # The table at the lowest temperature of the sweep (the reports' own figures), then one at 0.7 and one at 1.
    lowest, *others = ablate.stdout.split("decoded τ at temperature ")
    assert [other.splitlines()[0] for other in others] == ["0.7:", "1:"]
    assert all("| τ mt-bench T=1 |" in other for other in others[1:])
    table = [line for line in lowest.splitlines() if line.startswith("| ablation-")]
    # a data variant too: the same answers prepared with --trim-loops, the baseline recipe on them
    assert [line.split(" | ")[0] for line in table] == ["| ablation-anchors4", "| ablation-base",
                                                       "| ablation-trim_loops"]
    assert (out / "prepared-trim_loops" / "dflash_data.json").is_file()
    header = next(line for line in lowest.splitlines() if line.startswith("| run |"))
    assert header.endswith("| τ humaneval | τ math-synthetic | τ mt-bench |")  # each run's decoded τ
    assert all(not line.endswith("| — |") for line in table)
    launches = [line for line in ablate.stderr.splitlines() if "dflash_train.cli train" in line]
    assert len(launches) == 3 and all("training.time_budget_excludes_warmup=true" in line for line in launches)
    assert (out / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    totals = speedrun("summary", out).stdout
    stage_minutes = [(line.split()[0], float(line.split()[1])) for line in totals.splitlines()
                     if line.startswith("  ") and len(line.split()) == 2]
    assert {"curve", "ablate"} <= dict(stage_minutes).keys()  # shown, but not counted in the speedrun's total
    # The total is the stages' seconds summed (each line is rounded to 0.1 minute on its own, so their sum may
    # be off by more than that): the curve and ablate stages left out.
    rows = [line.split("\t") for line in (out / "times.tsv").read_text().splitlines()]
    counted = sum(int(seconds) for stage, seconds in rows if stage not in ("curve", "ablate"))
    assert dict(stage_minutes)["total"] == pytest.approx(counted / 60, abs=0.051)


@pytest.mark.slow
@needs_smollm2
def test_speedrun_chats_are_regenerated_turn_after_turn(tmp_path: pathlib.Path) -> None:
    """CHATS: whole conversations, each user turn answered by the target after its own earlier answers, are
    prepared beside the MIX answers (whose copies of the chats' first turns are left out)."""
    questions = [("Name a fruit.", "And a vegetable?"), ("What is 2+3?", "And times 4?"),
                 ("Say hello.", "Now in French."), ("Pick a colour.", "Why that one?")]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": first}, {"role": "assistant", "content": "placeholder one"},
        {"role": "user", "content": second}, {"role": "assistant", "content": "placeholder two"}]}) + "\n"
        for first, second in questions))
    out = tmp_path / "run"
    for stage in ("prompts", "regenerate", "prepare"):
        done = speedrun(stage, out, CHATS=f"{chats}=4", CHAT_TURNS="2",
                        MIX=f"{chats}=4 {REPO / 'data/prompts/demo_prompts.jsonl'}=8")
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    packed = [json.loads(line)["messages"][0]["content"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(packed) == 8 and not {first for first, _ in questions} & set(packed)  # chats' first turns left out
    rows = [json.loads(line) for path in sorted((out / "regen-chat").glob("part-*.jsonl"))
            for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    assert len(rows) == 4
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert not any(m["content"].startswith("placeholder") for m in row["messages"])
    summary = json.loads((out / "prepared" / "dflash_data.json").read_text())
    assert [pathlib.Path(source).name for source in summary["sources"]] == ["regen", "regen-chat"]
    assert summary["counts"]["read"] == 12


@pytest.mark.slow
@needs_smollm2
def test_speedrun_on_two_processes(tmp_path: pathlib.Path) -> None:
    """`GPUS=2` as an 8-GPU run takes it, on two CPU processes: self-prompts and regeneration once per rank,
    training under `accelerate launch` (the CPU launch config in place of DDP on GPUs), each eval on one process,
    as a user decodes, the float32 one beside the headline; the run's drafter is lossless and exports."""
    out = tmp_path / "run"
    run = speedrun("all", out, GPUS="2", LAUNCH_CONFIG="recipes/accelerate/cpu_2proc.yaml", RUN_PORT="29613",
                   EVAL_TEMPERATURES="0", BATCH8_PROMPTS="0", SELF_PROMPTS="4",
                   SELF_PROMPT_EXTRA="--max-new-tokens 48")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    # each rank's self-prompts in a file of its own, both packed into the mix
    by_rank = [[json.loads(line) for line in (out / f"self_prompts.rank{rank}-of2.jsonl").read_text().splitlines()]
               for rank in (0, 1)]
    assert all(row["source_index"] % 2 == rank for rank, rows in enumerate(by_rank) for row in rows)
    written = by_rank[0] + by_rank[1]
    packed = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert written
    assert sum(row.get("source") == "self-prompts" for row in packed) == len(
        {row["messages"][0]["content"].strip().lower() for row in written})
    assert "+ the evals on 2 GPUs, side by side" in run.stderr
    assert "accelerate.commands.launch --config_file recipes/accelerate/cpu_2proc.yaml --num_processes 2" in run.stderr
    (state,) = (out / "train" / "main" / "checkpoints").glob("step-*/trainer_state.json")
    trained = json.loads(state.read_text())
    assert trained["num_processes"] == 2 and trained["distributed_type"] == "MULTI_CPU"
    rows = json.loads((out / "summary.json").read_text())
    assert rows and all(row["lossless"] == "yes" for row in rows)
    assert (out / "export" / "config.json").is_file()
