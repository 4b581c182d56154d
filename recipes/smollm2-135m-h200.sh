#!/usr/bin/env bash
# The full SmolLM2-135M-Instruct recipe (its runs: docs/results.md), on one GPU or more, stage by stage.
#
#   bash recipes/smollm2-135m-h200.sh data        # regenerate ShareGPT + generated-math responses, tokenise
#   bash recipes/smollm2-135m-h200.sh train       # the recipe, plus the three ablation runs, side by side
#   bash recipes/smollm2-135m-h200.sh eval        # τ / lossless / speedup on HumanEval and MT-Bench, export
#   bash recipes/smollm2-135m-h200.sh all
#
# Every stage resumes: re-running a stage after a kill continues where it stopped (regeneration by shard,
# training from the last checkpoint, with the run length it settled on). Settings (environment):
#   TARGET          alias, local directory or .gguf of the target (default: smollm2-135m-instruct)
#   PROMPTS         regenerate's input arguments (default: 8,000 ShareGPT + 2,000 generated math prompts;
#                   `python -m dflash_train.prompts.pack` writes the same as one file for an offline node)
#   OUT             where everything goes (default: outputs/smollm2-h200)
#   TRAIN_MINUTES   wall-time budget of the main run; its cosine schedule is fitted to it (default: 7)
#   ABLATION_STEPS  optimizer steps of each ablation run (default: 600)
#   EVAL_PROMPTS    prompts per eval set for the main drafter at block 16 (default: 80)
#   ABLATION_EVAL_PROMPTS   the same for the ablations, block 8 and float32 (default: 40)
#   EVAL_NEW_TOKENS tokens each eval request answers (default: 256)
#   ABLATION_EVAL_BATCH     requests in flight for those evals (default: 8; τ and lossless do not depend on
#                   it, and the speedup of the main run is measured at batch 1)
#   ALLOW_UNFINISHED=1   evaluate a run's newest checkpoint even if it has not reached its last step
#   ABLATIONS=0     train and evaluate the main run only (the whole GPU for it)
#   GPUS            GPUs to train on (default 1): more launch each run with `accelerate launch` and DDP
#                   (BATCH_SIZE sequences per GPU), and the evaluations share the GPUs (main-b16 alone on
#                   the first, for its wall-clock speedup; block 8 and float32 on the second)
#   LAUNCH_CONFIG   accelerate config for GPUS > 1 (default recipes/accelerate/ddp.yaml; fsdp2.yaml,
#                   deepspeed_zero2.yaml, or cpu_2proc.yaml for CPU processes, work the same)
#   HELDOUT         a prompt file the main drafter is also evaluated on (default: 100 ShareGPT prompts
#                   right after the 8,000 packed for training, written by the data stage: in-domain, unseen)
#   DEADLINE        optional unix time: training stops (checkpointed) 30 s before it; re-run to resume
#   TRACKING        wandb | none (default: wandb; offline without a key)
#   REGEN_MINUTES   optional: stop regenerating after this long and prepare the finished shards only
#   REGEN_TURNS     user turns answered per conversation (default 1; `all` with prompt files packed with
#                   `pack --whole-conversations`: more supervised tokens from the same conversations)
#   EXTRA_PROMPTS   optional: regenerate's input arguments for more training prompts (own folder
#                   regen-extra, prepared with the rest), e.g. the ShareGPT prompts the default set and
#                   the held-out set leave: `python -m dflash_train.prompts.pack --source sharegpt=20000
#                   --exclude $OUT/prompts.jsonl --exclude $OUT/heldout-sharegpt.jsonl --out more.jsonl`
#   MAX_NEW_TOKENS, MAX_LENGTH, TRAIN_EXTRA   response cap (512), sequence cap (2048), extra train overrides
#   NUM_ANCHORS, BATCH_SIZE, LEARNING_RATE    256, 16 sequences per step, 1e-3
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${1:?usage: bash recipes/smollm2-135m-h200.sh data|train|eval|all}
TARGET=${TARGET:-smollm2-135m-instruct}
OUT=${OUT:-outputs/smollm2-h200}
PROMPTS=${PROMPTS:---data $OUT/prompts.jsonl}
TRAIN_MINUTES=${TRAIN_MINUTES:-7}
ABLATION_STEPS=${ABLATION_STEPS:-600}
EVAL_PROMPTS=${EVAL_PROMPTS:-80}
EVAL_NEW_TOKENS=${EVAL_NEW_TOKENS:-256}
ABLATION_EVAL_PROMPTS=${ABLATION_EVAL_PROMPTS:-40}
ABLATION_EVAL_BATCH=${ABLATION_EVAL_BATCH:-8}
TRACKING=${TRACKING:-wandb}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-512}
MAX_LENGTH=${MAX_LENGTH:-2048}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
ABLATIONS=${ABLATIONS:-1}
HELDOUT=${HELDOUT:-$OUT/heldout-sharegpt.jsonl}
EXTRA_PROMPTS=${EXTRA_PROMPTS:-}
GPUS=${GPUS:-1}
LAUNCH_CONFIG=${LAUNCH_CONFIG:-recipes/accelerate/ddp.yaml}
NUM_ANCHORS=${NUM_ANCHORS:-256}
BATCH_SIZE=${BATCH_SIZE:-16}
LEARNING_RATE=${LEARNING_RATE:-1e-3}
RECIPE=recipes/smollm2-135m-dflash-b16.yaml
DFLASH="python3 -m dflash_train.cli"

stop_after() {  # minutes left before DEADLINE, as a training override (nothing without a DEADLINE)
  [[ -n "${DEADLINE:-}" ]] && python3 -c "import time; print(f'training.stop_after_minutes={max(0.1, (${DEADLINE} - 30 - time.time()) / 60):.2f}')"
  return 0
}

regenerate_into() {  # output folder, then regenerate's input arguments; GPUS > 1: one rank per GPU
  local out=$1; shift
  local limit=() ranks=() failed=0
  [[ -n "${REGEN_MINUTES:-}" ]] && limit=(timeout "${REGEN_MINUTES}m")
  local run=($DFLASH regenerate --target "$TARGET" "$@" --max-new-tokens "$MAX_NEW_TOKENS" --batch-size 256
             --max-prompt-tokens 1024 --dtype bf16 --turns "${REGEN_TURNS:-1}" --out "$out")
  if (( GPUS > 1 )); then
    for ((rank = 0; rank < GPUS; rank++)); do
      LOCAL_RANK=$rank "${limit[@]}" "${run[@]}" --rank "$rank" --world-size "$GPUS" &
      ranks+=($!)
    done
    for pid in "${ranks[@]}"; do wait "$pid" || failed=$?; done
    (( failed == 0 )) || return "$failed"
  fi
  "${limit[@]}" "${run[@]}"  # one GPU: all of it; after the ranks: finds every shard and completes the manifest
}

data() {
  if [[ "$PROMPTS" == "--data $OUT/prompts.jsonl" && ! -f "$OUT/prompts.jsonl" ]]; then
    python3 -m dflash_train.prompts.pack --source sharegpt=8000 --source reasoning-gym-math:steps=2000 --out "$OUT/prompts.jsonl"
    # The same shuffle, 100 prompts further: ShareGPT prompts the drafter never trains on.
    python3 -m dflash_train.prompts.pack --source sharegpt=100 --exclude "$OUT/prompts.jsonl" \
      --out "$OUT/heldout-sharegpt.jsonl"
  fi
  local partial=() sets=(--data "$OUT/regen")
  # shellcheck disable=SC2086  # PROMPTS and EXTRA_PROMPTS are lists of arguments
  regenerate_into "$OUT/regen" $PROMPTS || {
    local code=$?
    [[ $code == 124 ]] || return $code
    echo "regeneration stopped after REGEN_MINUTES=$REGEN_MINUTES; training on its finished shards" >&2
    partial=(--allow-unfinished)
  }
  if [[ -n "$EXTRA_PROMPTS" ]]; then
    # shellcheck disable=SC2086
    regenerate_into "$OUT/regen-extra" $EXTRA_PROMPTS || {
      local code=$?
      [[ $code == 124 ]] || return $code
      echo "extra regeneration stopped after REGEN_MINUTES=$REGEN_MINUTES; its finished shards are used" >&2
      partial=(--allow-unfinished)
    }
    sets+=(--data "$OUT/regen-extra")
  fi
  [[ -f "$OUT/prepared/dflash_data.json" ]] ||
    $DFLASH prepare --target "$TARGET" "${sets[@]}" "${partial[@]}" --max-length "$MAX_LENGTH" \
      --block-size 16 --out "$OUT/prepared"
}

train_run() {  # name, then overrides; RUN_PORT: the run's rendezvous port when it runs on several GPUs
  local name=$1; shift
  local launch=($DFLASH train)
  (( GPUS > 1 )) && launch=(python3 -m accelerate.commands.launch --config_file "$LAUNCH_CONFIG"
    --num_processes "$GPUS" --main_process_port "${RUN_PORT:-29501}" -m dflash_train.train)
  # Responses are capped at MAX_NEW_TOKENS (512): 256 anchors cover them (the recipe's 512 suits 3k-token
  # chats); 16 sequences per step keep the GPU busy with a 576-wide drafter.
  "${launch[@]}" --config "$RECIPE" "model.target=$TARGET" "data.prepared=$OUT/prepared" \
    "training.num_anchors=$NUM_ANCHORS" "training.batch_size=$BATCH_SIZE" "training.learning_rate=$LEARNING_RATE" \
    "training.output_dir=$OUT/train/$name" "tracking.report_to=$TRACKING" "tracking.run_name=$name" \
    "data.max_length=$MAX_LENGTH" "training.save_every=200" "training.eval_every=400" $(stop_after) "$@" \
    $TRAIN_EXTRA >> "$OUT/train/$name.log" 2>&1  # appended: a resumed run keeps its earlier lines
}

train() {
  mkdir -p "$OUT/train"
  # The main run and the ablations share the GPU (a 135M target leaves most of it idle). The ablations
  # see the same sequences for the same number of steps and differ in one choice each.
  train_run main "training.time_budget_minutes=$TRAIN_MINUTES" &
  local main_job=$!
  [[ "$ABLATIONS" == 1 ]] || { wait "$main_job"; tail -n 3 "$OUT/train/main.log"; return; }
  RUN_PORT=29502 train_run ablation-random-anchors "training.max_steps=$ABLATION_STEPS" &
  RUN_PORT=29503 train_run ablation-partition-anchors "training.max_steps=$ABLATION_STEPS" "training.anchors=partition" &
  RUN_PORT=29504 train_run ablation-no-decay "training.max_steps=$ABLATION_STEPS" "training.loss_decay_gamma=.inf" &
  local failed=0
  for job in $(jobs -p); do wait "$job" || failed=1; done
  tail -n 3 "$OUT"/train/*.log
  return $failed
}

final_draft() {  # the newest checkpoint's drafter if that run reached its last step (or ALLOW_UNFINISHED=1)
  python3 - "$1" "${ALLOW_UNFINISHED:-0}" <<'EOF'
import sys
from pathlib import Path
from dflash_train.demo import final_checkpoint
from dflash_train.training.resume import list_checkpoints
found = final_checkpoint(Path(sys.argv[1]))
if found is None and sys.argv[2] == "1":
    found = (list_checkpoints(Path(sys.argv[1])) or [None])[-1]
print(found / "draft" if found else "")
EOF
}

evaluate() {  # run name, report name, prompts per set, extra eval arguments
  local draft; draft=$(final_draft "$OUT/train/$1")
  [[ -n "$draft" ]] || { echo "$1 has not finished training: run the train stage again" >&2; return 1; }
  [[ -f "$OUT/eval/$2.json" ]] && { echo "$2: evaluated earlier ($OUT/eval/$2.json)"; return 0; }
  local heldout=()
  [[ -f "$HELDOUT" ]] && heldout=(--dataset "$HELDOUT")
  # shellcheck disable=SC2086  # EVAL_PIN is a command prefix (taskset -c CPUS) or nothing
  ${EVAL_PIN:-} $DFLASH eval --target "$TARGET" --draft "$draft" --dataset humaneval --dataset mt-bench "${heldout[@]}" \
    --num-prompts "$3" --max-new-tokens "$EVAL_NEW_TOKENS" --no-progress --out "$OUT/eval/$2.json" "${@:4}"
}

other_evals() {  # the ablations, block 8 and float32, at ABLATION_EVAL_BATCH requests in flight
  local failed=0
  local batch=(--batch-size "$ABLATION_EVAL_BATCH") ablations=(random-anchors partition-anchors no-decay)
  [[ "$ABLATIONS" == 1 ]] || ablations=()
  for run in "${ablations[@]}"; do
    evaluate "ablation-$run" "ablation-$run" "$ABLATION_EVAL_PROMPTS" "${batch[@]}" || failed=1
  done
  evaluate main main-b8 "$ABLATION_EVAL_PROMPTS" --block-size 8 "${batch[@]}" || failed=1
  # The lossless check is exact in bf16 as well; float32 repeats it at another precision (uncompiled: a
  # correctness check need not wait for compilation). Last: the slowest of these.
  evaluate main main-fp32 "$ABLATION_EVAL_PROMPTS" --dtype float32 --no-compile "${batch[@]}" || failed=1
  return $failed
}

main_eval() {  # block 16 at batch 1, alone on its GPU (its speedup is a wall-clock measurement); export
  evaluate main main-b16 "$EVAL_PROMPTS" &&
    $DFLASH export "$(final_draft "$OUT/train/main")" --target "$TARGET" --eval-report "$OUT/eval/main-b16.json" \
      --overwrite --out "$OUT/export" &&
    $DFLASH check "$OUT/export" --target "$TARGET"
}

eval_all() {
  mkdir -p "$OUT/eval"
  local failed=0
  if (( GPUS > 1 )); then
    # Disjoint CPU sets: at SmolLM2's size a batch-1 decode loop is bound by host latency, and the other
    # GPU's evaluations (compilation workers included) would otherwise slow the timed loop down.
    local cpus half pin_main="" pin_other=""
    cpus=$(nproc); half=$(( cpus / 2 ))
    if command -v taskset > /dev/null && (( half >= 2 )); then
      pin_main="taskset -c 0-$(( half - 1 ))"; pin_other="taskset -c $half-$(( cpus - 1 ))"
    fi
    EVAL_PIN=$pin_other CUDA_VISIBLE_DEVICES=1 other_evals > "$OUT/eval/other.log" 2>&1 &
    local others=$!
    EVAL_PIN=$pin_main CUDA_VISIBLE_DEVICES=0 main_eval || failed=1
    wait "$others" || failed=1
    cat "$OUT/eval/other.log"
  else
    main_eval || failed=1
    other_evals || failed=1
  fi
  python3 -m recipes.scoring.summary "$OUT"
  return $failed
}

case "$STAGE" in
  data) data ;;
  train) train ;;
  eval) eval_all ;;
  all) data && train && eval_all ;;
  *) echo "unknown stage $STAGE: use data, train, eval or all" >&2; exit 2 ;;
esac
