#!/usr/bin/env bash
# The speedrun: the best SmolLM2-135M-Instruct drafter one GPU trains from nothing in about 25 minutes,
# everything included: prompts -> the target regenerates the answers -> tokenised chats -> packed training
# -> τ and speedup on HumanEval, MT-Bench and a math set, greedy and sampled -> export and check. One table at
# the end.
#
#   bash recipes/smollm2-135m-speedrun.sh all
#   bash recipes/smollm2-135m-speedrun.sh prompts|regenerate|prepare|train|eval|summary   # one stage
#   (data = regenerate + prepare)
#   bash recipes/smollm2-135m-speedrun.sh curve     # after data: τ against GPU-minutes of training (CURVE_MINUTES)
#   bash recipes/smollm2-135m-speedrun.sh ablate    # after data: recipe changes at equal minutes (ABLATIONS)
#
# Each stage is an ordinary dflash-train command (printed before it runs), resumes where it stopped and is
# skipped once finished, so the run can be split across time-limited calls of a GPU machine (one stage a
# call; a stage such a call kills keeps its minutes in times.tsv, and regeneration resumes with what REGEN_MINUTES
# has left). Nothing here is specific to SmolLM2 beyond the defaults: TARGET, MIX and the budgets scale it.
# Settings (environment):
#   TARGET          alias, local directory or .gguf (default: smollm2-135m-instruct)
#   OUT             where everything goes (default: outputs/speedrun)
#   PROMPTS         a prompt file to regenerate (default: $OUT/prompts.jsonl, packed from MIX)
#   MIX             `dflash_train.prompts.pack` sources (default: ~84k distinct prompts, decontaminated:
#                   15.6k ShareGPT, 32k code-writing prompts, 30k generated math asking for worked solutions
#                   (`:steps`: bare-result math gave answers too short to train on, in a style the math eval
#                   never sees), 6k generated word problems asking for worked solutions (with them and more
#                   self-prompts, math τ rose by about one: docs/results.md); with SELF_PROMPTS, ~159k)
#   CHATS           optional `pack` sources of whole conversations (e.g. "sharegpt=20000"): regenerated first,
#                   CHAT_TURNS user turns each (default 3; `all`), each answered after the target's own earlier
#                   answers; their first turns are left out of MIX
#   SELF_PROMPTS    chat prompts the target writes itself (`dflash-train self-prompt`: sampled user turns,
#                   distinct, decontaminated), packed into the mix beside MIX in the prompts stage, which then
#                   needs the GPU and the target (default 75000, a few minutes, taken off REGEN_MINUTES; 0:
#                   none). In place of openai-evals prompts they raised MT-Bench τ at equal minutes, and more
#                   of them raised the kept chats; 75k for >= 150k kept chats (docs/results.md, the speedrun's
#                   runs). SELF_PROMPT_EXTRA: more self-prompt flags
#   SELF_MATH_PROMPTS   math word problems the target writes itself (`self-prompt --opening`, SELF_MATH_OPENING),
#                   each followed by a request for a worked solution in \boxed{}, packed beside the other
#                   self-prompts as source self-prompts:math: the target's answers in the style it uses on the
#                   word problems of the math eval set, which the generated math lacks (default 0: none; their
#                   minutes come off REGEN_MINUTES too)
#   DATA_SCALE      multiplies every prompt count of MIX, CHATS, SELF_PROMPTS and SELF_MATH_PROMPTS (default 1;
#                   a source that holds fewer gives what it has). With GPUS=8, regeneration answers the default
#                   prompts in about an eighth of the minutes and training passes over each chat about eight times
#                   as often: DATA_SCALE=8 keeps the passes a chat gets near one GPU's (what τ gains from either
#                   is not measured yet)
#   TRIM_LOOPS      1: prepare cuts answers the token cap stopped inside a verbatim loop to two copies of it
#                   (`prepare --trim-loops`: about a fifth of a speedrun's answers, docs/data.md); default 0
#   STOP_LOOPS      1 (default): regeneration ends an answer inside a verbatim loop (`regenerate --stop-loops`)
#                   instead of decoding it to the cap, and its row takes the next prompt: more answers a minute
#                   from the same prompts (docs/results.md, 'Loop stopping'); 0: decode every answer to the cap
#                   or its end
#   SAMPLES         answers per prompt: 1 greedy (default); K > 1 samples all K at TEMPERATURE, none greedy
#   SAMPLED_MINUTES the target's minutes of sampled answers beside the greedy ones (default 0: none): after the
#                   greedy answers, the same prompts from the first answered once more at SAMPLED_TEMPERATURE
#                   (default 1.0) into $OUT/regen-sampled, prepared with the greedy ones; on top of REGEN_MINUTES,
#                   so training's share of TOTAL_MINUTES shrinks by them. A share of sampled answers keeps more of
#                   the greedy τ at temperature 1 for a little of it at 0 (docs/results.md, 'A sampled answer
#                   beside the greedy ones')
#   REGEN_MINUTES   the target's minutes of data: stop regenerating after this long, less what writing
#                   SELF_PROMPTS took; training uses the finished shards (default 9.5: room for every prompt of
#                   the default mix at the slower regeneration pace the speedruns saw, where a lower budget left
#                   units unanswered, docs/results.md; a budget not spent goes to training through TOTAL_MINUTES)
#   TOTAL_MINUTES   the whole run's budget of timed stages (default 24: the speedrun's 25 minutes less about one for
#                   copying the target and installing, which no stage times): training gets what the data stages
#                   (times.tsv) and EVAL_RESERVE_MINUTES leave, fixed once in $OUT/train_minutes, so a machine that
#                   regenerates faster trains longer and a slow one still ends in time
#   EVAL_RESERVE_MINUTES   kept back for the eval stage and training's own loading and first step (default 5: about
#                   what a speedrun's eval and its training's overrun over two calls took, docs/results.md, with
#                   the eval at temperature 0 alone; the EVAL_TEMPERATURES sweep's extra minutes are not in it:
#                   raise it by those to keep the run inside TOTAL_MINUTES, docs/recipes.md)
#   TRAIN_MINUTES   wall-time budget of training, its schedule fitted to it, in place of TOTAL_MINUTES's share
#                   (default: that share)
#   TRAIN_EXTRA     more training overrides (e.g. "training.batch_size=4"); the recipe is smollm2-135m-dflash-b16-packed
#   GOALS           what the summary checks the run against (`python -m recipes.scoring.summary --goal`): τ per
#                   eval set, the lowest speedup, chats kept, the stages' minutes, the training step's MFU in
#                   percent (default "humaneval=4.5 mt-bench=4.5 math-synthetic=5.5 speedup=2.5 chats=150000
#                   minutes=25 mfu=30"; empty: none)
#   CURVE_MINUTES   training budgets of the curve stage's runs (default "5 10 20"), each evaluated like main but
#                   on CURVE_PROMPTS prompts per set (default EVAL_PROMPTS) and without the lossless pass
#   CHECK_EVERY     steps between a training run's held-out validations and checkpoints (default 1000; the
#                   ablate stage's runs: ABLATION_CHECK_EVERY, default 400). Each takes seconds, so checking
#                   much more often would spend a real share of a short run's minutes on them; a run stopped by
#                   STOP_AFTER saves anyway
#   STOP_AFTER      minutes after which a training run saves and stops (training.stop_after_minutes), for a
#                   machine lent for less than a run takes: the same stage resumes it on the next call
#   ABLATIONS       the ablate stage's runs, "name:override ...;name:override ..." (default: the changes not yet
#                   measured against today's recipe: 16 anchors per chat instead of 32, the trend's next step, and
#                   twice both learning rates, last measured at 250 steps of a much earlier recipe where runs
#                   now take thousands; measured before and not adopted: 3 and 8 drafter layers, 64 to 256 anchors,
#                   half, twice and four times the tokens a step (one row or 4 rows of 8,192, 4 rows of 16,384),
#                   one row of 16,384, the fixed slot decay, code and math weighted twice; empty: the baseline
#                   only; any training key, e.g. the objective at a temperature:
#                   "kl07:training.loss=kl training.loss_temperature=0.7 training.distill_weight=0.5", or the
#                   sources weighted: "codemath:data.source_weights.code-prompts=2 data.source_weights.self-prompts=0.5"), each
#                   ABLATION_MINUTES (default 3, compilation not counted) beside a baseline; compared in a table
#                   ($OUT/ablations.md) and $OUT/ablations.png by held-out τ̂ and by the τ each decodes on ABLATION_EVAL_PROMPTS
#                   prompts per eval set (default 20; 0: none), with paired Δτ against the baseline, at each of
#                   ABLATION_TEMPERATURES (default 0; a list gives one table per temperature, the lowest first)
#   ABLATION_DATA   the ablate stage's data variants, "name:prepare flags;...": the same answers prepared again
#                   with those flags (after the stage's own, so they win) into $OUT/prepared-NAME, one run on each
#                   beside the others (default "maxlen512:--max-length 512;noself:--exclude-source self-prompts;
#                   trim_loops:--trim-loops": chats capped at 512 tokens instead of MAX_LENGTH (a cap of 1,024
#                   touches 0.2 % of the speedrun's chats, too few to measure), the mix without the target's own
#                   prompts, so the code, math and ShareGPT chats get all the steps, and loops cut to two
#                   copies; empty: none; maxlen512 and noself both lost on MT-Bench τ, docs/results.md). Their
#                   held-out τ̂ is on their own version of the held-out chats (same prompts): judge them by decoded τ
#   ABLATION_REGEN  the ablate stage's answer variants, "name:regenerate flags;...": the same prompts answered again
#                   with those flags (after the stage's own) for ABLATION_REGEN_MINUTES (default REGEN_MINUTES, so at
#                   equal target-minutes of data) into $OUT/regen-NAME, prepared into $OUT/prepared-NAME, one run of the
#                   baseline recipe on each (default empty; e.g. "sampled:--samples-per-prompt 2 --temperature 1.0":
#                   two sampled answers a prompt instead of the greedy one, for drafters served at a temperature).
#                   A name ending in + ("mixed+:--temperature 1.0") prepares the variant's answers beside the
#                   stage's own greedy ones ($OUT/prepared-mixed, run ablation-mixed): a mix that costs the
#                   variant's minutes on top of REGEN_MINUTES (set ABLATION_REGEN_MINUTES for the share)
#   REGEN_EXTRA, EVAL_EXTRA   more flags for regenerate and for the bf16 eval (e.g. "--kernels torch")
#   EVAL_DRAFT      a drafter folder (a checkpoint's draft/ or an export) the eval stage evaluates, exports and
#                   checks in place of the main run's: one trained on another machine and copied here, when the
#                   machine that trained it is gone (copy its trainer_state.json and metrics.jsonl under
#                   $OUT/train/main as well, and the summary reports its training too)
#   EVAL_PROMPTS    prompts per eval set (default 40; MT-Bench counts two turns each); FP32_PROMPTS for the exact
#                   float32 check at batch 8 (default 16); BATCH8_PROMPTS for the bf16 eval at batch 8 (τ, speedup
#                   and the exact check with 8 requests decoded together; default 16, 0: none)
#   EVAL_NEW_TOKENS answer length in the bf16 eval (default 256; half of it in the float32 check)
#   EVAL_TEMPERATURES   the bf16 batch-1 eval's temperatures, one sweep over the same prompts and seed
#                   (`eval --temperature`; default 0, inside the run's 25 minutes; 0,0.7,1: τ and speedup as chats
#                   are served too, and the share of the greedy τ each keeps, a longer eval). 0 must be in it: the
#                   run's own figures, its goals and the exact check are at 0. The batch-8, float32 and curve evals
#                   stay at 0
#   MAX_NEW_TOKENS, MAX_LENGTH, DECODE_ROWS   answer cap (512), chat cap (2048), rows decoded at once when
#                   regenerating and self-prompting (1024: faster than 512, docs/benchmarks.md, `regenerate`)
#   GPUS            GPUs to use (default 1): more write the self-prompts and regenerate one rank per GPU (each its
#                   share of the prompts, of the shards) and train every run with `accelerate launch` (LAUNCH_CONFIG,
#                   default recipes/accelerate/ddp.yaml; RUN_PORT its rendezvous port, default 29501); each eval
#                   stays on one GPU, as a user decodes, the batch-8 and float32 ones beside the headline on GPUs
#                   of their own
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${1:?usage: bash recipes/smollm2-135m-speedrun.sh all|prompts|regenerate|prepare|data|train|eval|curve|ablate|summary}
TARGET=${TARGET:-smollm2-135m-instruct}
OUT=${OUT:-outputs/speedrun}
PROMPTS=${PROMPTS:-$OUT/prompts.jsonl}
MIX=${MIX:-sharegpt=20000 code-prompts=40000 reasoning-gym-math:steps=30000 word-problems:steps=6000}
CHATS=${CHATS:-}
CHAT_TURNS=${CHAT_TURNS:-3}
SELF_PROMPTS=${SELF_PROMPTS:-75000}
DATA_SCALE=${DATA_SCALE:-1}
TRIM_LOOPS=${TRIM_LOOPS:-0}
STOP_LOOPS=${STOP_LOOPS:-1}
SELF_PROMPT_EXTRA=${SELF_PROMPT_EXTRA:-}
SELF_MATH_PROMPTS=${SELF_MATH_PROMPTS:-0}
SELF_MATH_OPENING=${SELF_MATH_OPENING:-Here is a math word problem for you to solve:}
SAMPLES=${SAMPLES:-1}
TEMPERATURE=${TEMPERATURE:-0.7}
SAMPLED_MINUTES=${SAMPLED_MINUTES:-0}
SAMPLED_TEMPERATURE=${SAMPLED_TEMPERATURE:-1.0}
REGEN_MINUTES=${REGEN_MINUTES:-9.5}
TRAIN_MINUTES=${TRAIN_MINUTES:-}
TOTAL_MINUTES=${TOTAL_MINUTES:-24}
EVAL_RESERVE_MINUTES=${EVAL_RESERVE_MINUTES:-5}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
REGEN_EXTRA=${REGEN_EXTRA:-}
EVAL_EXTRA=${EVAL_EXTRA:-}
EVAL_DRAFT=${EVAL_DRAFT:-}
GOALS=${GOALS-humaneval=4.5 mt-bench=4.5 math-synthetic=5.5 speedup=2.5 chats=150000 minutes=25 mfu=30}
CURVE_MINUTES=${CURVE_MINUTES:-5 10 20}
STOP_AFTER=${STOP_AFTER:-}
ABLATIONS=${ABLATIONS-anchors16:training.num_anchors=16;lr2x:training.learning_rate=1.2e-3 training.muon_learning_rate=0.04}
ABLATION_DATA=${ABLATION_DATA-maxlen512:--max-length 512;noself:--exclude-source self-prompts;trim_loops:--trim-loops}
ABLATION_REGEN=${ABLATION_REGEN:-}
ABLATION_REGEN_MINUTES=${ABLATION_REGEN_MINUTES:-$REGEN_MINUTES}
ABLATION_MINUTES=${ABLATION_MINUTES:-3}
ABLATION_EVAL_PROMPTS=${ABLATION_EVAL_PROMPTS:-20}
EVAL_TEMPERATURES=${EVAL_TEMPERATURES:-0}
ABLATION_TEMPERATURES=${ABLATION_TEMPERATURES:-0}
CHECK_EVERY=${CHECK_EVERY:-1000}
ABLATION_CHECK_EVERY=${ABLATION_CHECK_EVERY:-400}
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
CURVE_PROMPTS=${CURVE_PROMPTS:-$EVAL_PROMPTS}
EVAL_NEW_TOKENS=${EVAL_NEW_TOKENS:-256}
FP32_PROMPTS=${FP32_PROMPTS:-16}
BATCH8_PROMPTS=${BATCH8_PROMPTS:-16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-512}
MAX_LENGTH=${MAX_LENGTH:-2048}
DECODE_ROWS=${DECODE_ROWS:-1024}
GPUS=${GPUS:-1}
LAUNCH_CONFIG=${LAUNCH_CONFIG:-recipes/accelerate/ddp.yaml}
[[ "$BATCH8_PROMPTS" =~ ^[0-9]+$ ]] || {
  echo "BATCH8_PROMPTS must be a count of prompts (0 for none), not '$BATCH8_PROMPTS'" >&2; exit 2; }
[[ "$ABLATION_EVAL_PROMPTS" =~ ^[0-9]+$ ]] || {
  echo "ABLATION_EVAL_PROMPTS must be a count of prompts (0 for none), not '$ABLATION_EVAL_PROMPTS'" >&2; exit 2; }
[[ "$TRIM_LOOPS" == 0 || "$TRIM_LOOPS" == 1 ]] || { echo "TRIM_LOOPS must be 0 or 1, not '$TRIM_LOOPS'" >&2; exit 2; }
[[ "$STOP_LOOPS" == 0 || "$STOP_LOOPS" == 1 ]] || { echo "STOP_LOOPS must be 0 or 1, not '$STOP_LOOPS'" >&2; exit 2; }
[[ "$SELF_PROMPTS" =~ ^[0-9]+$ ]] || { echo "SELF_PROMPTS must be a count of prompts (0 for none), not '$SELF_PROMPTS'" >&2; exit 2; }
[[ "$SELF_MATH_PROMPTS" =~ ^[0-9]+$ ]] || {
  echo "SELF_MATH_PROMPTS must be a count of prompts (0 for none), not '$SELF_MATH_PROMPTS'" >&2; exit 2; }
[[ "$DATA_SCALE" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v s="$DATA_SCALE" 'BEGIN { exit !(s > 0) }' || {
  echo "DATA_SCALE must be a number above 0 (what the prompt counts are multiplied by), not '$DATA_SCALE'" >&2; exit 2; }
for goal in $GOALS; do  # checked now, not when the summary reads them at the end of the run
  [[ "$goal" =~ ^[A-Za-z0-9_.-]+=[0-9]+([.][0-9]+)?$ ]] || {
    echo "GOALS entry '$goal' is not KEY=NUMBER (e.g. mt-bench=4.0 speedup=2 chats=150000 minutes=25)" >&2; exit 2; }
done
for temperatures in EVAL_TEMPERATURES ABLATION_TEMPERATURES; do  # eval refuses repeats; the form is checked here
  [[ "${!temperatures}" =~ ^[0-9]+([.][0-9]+)?(,[0-9]+([.][0-9]+)?)*$ ]] || {
    echo "$temperatures must be a comma list of temperatures (e.g. 0,0.7,1 or 0), not '${!temperatures}'" >&2; exit 2; }
done
tr ',' '\n' <<< "$EVAL_TEMPERATURES" | awk '$1 == 0 { found = 1 } END { exit !found }' || {
  echo "EVAL_TEMPERATURES must include 0 (the run's own figures and its exact check), not '$EVAL_TEMPERATURES'" >&2
  exit 2; }
for minutes in TOTAL_MINUTES EVAL_RESERVE_MINUTES ABLATION_REGEN_MINUTES SAMPLED_MINUTES; do
  [[ "${!minutes}" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$minutes must be a number of minutes, not '${!minutes}'" >&2; exit 2; }
done
[[ "$SAMPLED_TEMPERATURE" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v t="$SAMPLED_TEMPERATURE" 'BEGIN { exit !(t > 0) }' || {
  echo "SAMPLED_TEMPERATURE must be a temperature above 0 (sampled answers), not '$SAMPLED_TEMPERATURE'" >&2; exit 2; }
[[ -z "$TRAIN_MINUTES" || "$TRAIN_MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]] || {
  echo "TRAIN_MINUTES must be a number of minutes (empty: TOTAL_MINUTES's share), not '$TRAIN_MINUTES'" >&2; exit 2; }
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "GPUS must be a whole number of GPUs (1 or more), not '$GPUS'" >&2; exit 2; }
(( GPUS == 1 )) || [[ -f "$LAUNCH_CONFIG" ]] || {
  echo "LAUNCH_CONFIG $LAUNCH_CONFIG does not exist: give one of recipes/accelerate/*.yaml" >&2; exit 2; }
DFLASH=(python3 -m dflash_train.cli)
mkdir -p "$OUT"

scaled() {  # a count times DATA_SCALE, rounded
  awk -v n="$1" -v s="$DATA_SCALE" 'BEGIN { printf "%d", n * s + 0.5 }'
}

scaled_sources() {  # pack sources, each NAME=COUNT's count times DATA_SCALE (the last = separates the count)
  local source
  for source in "$@"; do
    if [[ "$source" == *=* && "${source##*=}" =~ ^[0-9]+$ ]]; then
      printf '%s=%s ' "${source%=*}" "$(scaled "${source##*=}")"
    else
      printf '%s ' "$source"
    fi
  done
}

if [[ "$DATA_SCALE" != 1 ]]; then
  # shellcheck disable=SC2086  # the source lists split into their entries
  MIX=$(scaled_sources $MIX) CHATS=$(scaled_sources $CHATS)
  SELF_PROMPTS=$(scaled "$SELF_PROMPTS") SELF_MATH_PROMPTS=$(scaled "$SELF_MATH_PROMPTS")
fi

run() {  # print, then run, a command
  echo "+ $*" >&2
  "$@"
}

timed() {  # stage name, then the function: its seconds are appended to $OUT/times.tsv
  local name=$1 started=$SECONDS beat; shift
  fold_cut_stage
  # A stage a time-limited call kills still counts: its seconds so far are kept in $OUT/times.open and
  # folded into times.tsv by the next stage (so the training budget and the total stay true).
  ( while sleep 5 && kill -0 $$ 2>/dev/null; do printf '%s\t%s\n' "$name" "$(( SECONDS - started ))" > "$OUT/times.open"; done ) </dev/null >/dev/null 2>&1 &
  beat=$!  # (its sleep holds no pipe of the caller's: a killed beat's last sleep would keep them open)
  trap "kill $beat 2>/dev/null" EXIT  # $beat expanded now: the trap may run after this function returned
  "$@"
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
  trap - EXIT
  rm -f "$OUT/times.open"
  printf '%s\t%s\n' "$name" "$(( SECONDS - started ))" >> "$OUT/times.tsv"
}

fold_cut_stage() {  # the seconds of a stage a killed call left in $OUT/times.open, into times.tsv
  [[ -f "$OUT/times.open" ]] || return 0
  cat "$OUT/times.open" >> "$OUT/times.tsv"
  rm -f "$OUT/times.open"
}

prompts() {
  local sources=() excluded=()
  if [[ -n "$CHATS" && ! -f "$OUT/chats.jsonl" ]]; then
    for source in $CHATS; do sources+=(--source "$source"); done
    run python3 -m dflash_train.prompts.pack "${sources[@]}" --whole-conversations --out "$OUT/chats.jsonl"
    sources=()
  fi
  [[ -f "$PROMPTS" ]] && return 0
  for source in $MIX; do sources+=(--source "$source"); done
  # (if, not &&: a function called inside an && list would run without set -e)
  if (( SELF_PROMPTS > 0 )); then
    # shellcheck disable=SC2086  # SELF_PROMPT_EXTRA is a list of flags
    self_prompt_set "$OUT/self_prompts.jsonl" "$SELF_PROMPTS" $SELF_PROMPT_EXTRA
  fi
  if (( SELF_MATH_PROMPTS > 0 )); then  # the target's own math word problems, each asked for a worked solution
    self_prompt_set "$OUT/self_prompts-math.jsonl" "$SELF_MATH_PROMPTS" --seed 1 --opening "$SELF_MATH_OPENING" \
      --request 'Solve it step by step, then give the final answer in \boxed{}.' --label math
  fi
  [[ -n "$CHATS" ]] && excluded=(--exclude "$OUT/chats.jsonl")  # their first turns are answered as chats
  # Interleaved: a regeneration stopped by REGEN_MINUTES has answered every source in proportion.
  run python3 -m dflash_train.prompts.pack "${sources[@]}" "${excluded[@]}" --interleave --out "$PROMPTS"
}

self_prompt_set() {  # file, count, more self-prompt flags: the target's own chat prompts, a source of the mix
  # like the others. Written once, their minutes paid from REGEN_MINUTES; with GPUS > 1 one rank a GPU, each its
  # share into a file of its own, every file a source of the pack (which keeps a prompt two ranks wrote once).
  local out=$1 count=$2 started=$SECONDS files=() rank file overwrite=(); shift 2
  if (( GPUS > 1 && count >= GPUS )); then
    for ((rank = 0; rank < GPUS; rank++)); do files+=("${out%.jsonl}.rank${rank}-of${GPUS}.jsonl"); done
    overwrite=(--overwrite)  # a killed stage's ranks that did finish write theirs again, the same
  else
    files=("$out")
  fi
  for file in "${files[@]}"; do
    [[ -f "$file" ]] && continue
    if (( ${#files[@]} > 1 )); then
      on_every_gpu "${DFLASH[@]}" self-prompt --target "$TARGET" --num-prompts "$count" --decode-rows "$DECODE_ROWS" \
        "${overwrite[@]}" --out "$out" "$@"
    else
      run "${DFLASH[@]}" self-prompt --target "$TARGET" --num-prompts "$count" --decode-rows "$DECODE_ROWS" \
        --out "$out" "$@"
    fi
    echo $(( SECONDS - started )) > "${out%.jsonl}.seconds"  # paid from REGEN_MINUTES
    break
  done
  for ((rank = 0; rank < ${#files[@]}; rank++)); do
    sources+=(--source "${files[$rank]}=$(( count / ${#files[@]} + (rank < count % ${#files[@]}) ))")
  done
}

on_every_gpu() {  # a command, run once per GPU as rank r of GPUS (LOCAL_RANK picks its device), after every
  # rank has ended: 0, a failing rank's exit status, or 124 if only timeouts (REGEN_MINUTES) stopped ranks
  (( GPUS > 1 )) || { run "$@"; return; }
  local rank pid code pids=() failed=0
  echo "+ on $GPUS GPUs: $*" >&2
  for ((rank = 0; rank < GPUS; rank++)); do
    LOCAL_RANK=$rank "$@" --rank "$rank" --world-size "$GPUS" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" && continue
    code=$?
    (( failed == 0 || failed == 124 )) && failed=$code
  done
  return "$failed"
}

regen_finished() {  # every prompt answered, the budget spent, or the answers already prepared
  [[ -f "$OUT/prepared/dflash_data.json" || -f "$OUT/regen.budget-spent" || -f "$OUT/regen.done" ]]
}

regen() {  # the greedy answers, then SAMPLED_MINUTES of sampled ones beside them
  regen_greedy
  sampled_answers || return 0
  [[ -f "$OUT/prepared/dflash_data.json" ]] && return 0
  regen_variant sampled "$SAMPLED_MINUTES" --temperature "$SAMPLED_TEMPERATURE"
}

sampled_answers() {  # whether the run prepares sampled answers beside the greedy ones
  awk -v minutes="$SAMPLED_MINUTES" 'BEGIN { exit !(minutes > 0) }'
}

regen_greedy() {
  # Stopped by REGEN_MINUTES, the run is marked budget-spent: a later call of this stage does not continue
  # it, and prepare takes its finished shards.
  local sampled=() loops=()
  (( SAMPLES > 1 )) && sampled=(--samples-per-prompt "$SAMPLES" --temperature "$TEMPERATURE")
  [[ "$STOP_LOOPS" == 1 ]] && loops=(--stop-loops)
  regen_finished && return 0
  # Whole conversations first, every round to the end (a conversation is only written with its last turn):
  # the target answers each user turn after its own earlier answers, as in MT-Bench's second turn.
  # shellcheck disable=SC2086  # REGEN_EXTRA is a list of flags
  [[ -z "$CHATS" ]] || on_every_gpu "${DFLASH[@]}" regenerate --target "$TARGET" --data "$OUT/chats.jsonl" \
    --turns "$CHAT_TURNS" --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-tokens 1024 --dtype bf16 \
    --batch-size 4096 --decode-rows "$DECODE_ROWS" "${loops[@]}" $REGEN_EXTRA --out "$OUT/regen-chat"
  # The target's minutes of data are one budget: what writing SELF_PROMPTS took comes off regeneration's, and
  # so do the seconds of earlier attempts a time-limited call cut short (their times.tsv rows).
  local spent=0 cut budget file
  for file in "$OUT"/self_prompts*.seconds; do
    [[ -f "$file" ]] && spent=$(( spent + $(< "$file") ))
  done
  cut=$(awk -F '\t' '$1 == "regenerate" { s += $2 } END { print s + 0 }' "$OUT/times.tsv" 2>/dev/null || echo 0)
  if (( cut > 0 )) && awk -v m="$REGEN_MINUTES" -v s=$(( spent + cut )) 'BEGIN { exit !(s >= m * 60) }'; then
    echo "regeneration's REGEN_MINUTES=$REGEN_MINUTES were spent by earlier calls: training on its finished shards" >&2
    touch "$OUT/regen.budget-spent"
    return 0
  fi
  budget=$(awk -v minutes="$REGEN_MINUTES" -v spent="$spent" -v cut="$cut" \
    'BEGIN { b = minutes * 60 - spent; b = b < 60 ? 60 : b; printf "%d", (cut > 0 ? b - cut : b) }')
  # --foreground keeps regeneration in this script's process group, so a call limit that kills the script's
  # group ends it too (a timeout of its own group would leave it decoding on)
  # shellcheck disable=SC2086  # REGEN_EXTRA is a list of flags
  on_every_gpu timeout --foreground "${budget}s" "${DFLASH[@]}" regenerate --target "$TARGET" --data "$PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-tokens 1024 --dtype bf16 --batch-size 4096 \
    --decode-rows "$DECODE_ROWS" "${sampled[@]}" "${loops[@]}" $REGEN_EXTRA --out "$OUT/regen" || {
    local code=$?
    [[ $code == 124 ]] || return $code
    echo "regeneration stopped after REGEN_MINUTES=$REGEN_MINUTES: training on its finished shards" >&2
    touch "$OUT/regen.budget-spent"
  }
  # Every prompt answered: a later call neither regenerates again nor takes this stage's row for a cut attempt.
  [[ -f "$OUT/regen.budget-spent" ]] || touch "$OUT/regen.done"
}

prepare() {
  local trim=() answers="$OUT/regen"
  [[ "$TRIM_LOOPS" == 1 ]] && trim=(--trim-loops)
  sampled_answers && answers+=" $OUT/regen-sampled"
  ANSWERS=$answers prepare_into "$OUT/prepared" "${trim[@]}"
}

prepare_into() {  # output directory, more prepare flags: the regenerated answers as training chats, once
  # ANSWERS: the regenerations to prepare (default $OUT/regen; an ABLATION_REGEN variant's $OUT/regen-NAME)
  # (several, space-separated: prepared together)
  local answers partial=() sets=()
  [[ -f "$1/dflash_data.json" ]] && return 0
  for answers in ${ANSWERS:-$OUT/regen}; do
    sets+=(--data "$answers")
    [[ -f "$answers.budget-spent" ]] && partial=(--allow-unfinished)
  done
  [[ -z "$CHATS" ]] || sets+=(--data "$OUT/regen-chat")
  # The caller's flags last: a data variant's --max-length overrides MAX_LENGTH.
  run "${DFLASH[@]}" prepare --target "$TARGET" "${sets[@]}" "${partial[@]}" --max-length "$MAX_LENGTH" \
    --block-size 16 "${@:2}" --out "$1"
}

train_run() {  # name, minutes: one training run with its schedule fitted to that budget; resumes
  # A finished run is not launched again: loading the target and the data only to exit takes half a minute.
  if [[ -n "$(final_draft "$1")" ]]; then echo "$1 has finished training" >&2; return 0; fi
  local stop=() launch=("${DFLASH[@]}" train)
  [[ -z "$STOP_AFTER" ]] || stop=("training.stop_after_minutes=$STOP_AFTER")
  (( GPUS > 1 )) && launch=(python3 -m accelerate.commands.launch --config_file "$LAUNCH_CONFIG" --num_processes "$GPUS"
    --main_process_port "${RUN_PORT:-29501}" -m dflash_train.train)
  # shellcheck disable=SC2086  # TRAIN_EXTRA is a list of overrides
  run "${launch[@]}" --config recipes/smollm2-135m-dflash-b16-packed.yaml "model.target=$TARGET" \
    "data.prepared=$OUT/prepared" "training.output_dir=$OUT/train/$1" "training.time_budget_minutes=$2" \
    "training.save_every=$CHECK_EVERY" "training.eval_every=$CHECK_EVERY" "tracking.report_to=none" "${stop[@]}" \
    $TRAIN_EXTRA
}

train() {
  local minutes; minutes=$(main_train_minutes) || return 2
  train_run main "$minutes"
}

main_train_minutes() {  # TRAIN_MINUTES, or the share of TOTAL_MINUTES the data stages and the eval leave (kept once)
  local kept="$OUT/train_minutes" spent minutes
  [[ -n "$TRAIN_MINUTES" ]] && { echo "$TRAIN_MINUTES"; return 0; }
  [[ -f "$kept" ]] && { cat "$kept"; return 0; }  # a resumed run keeps its schedule's budget
  spent=$(awk -F '\t' '$1 == "prompts" || $1 == "regenerate" || $1 == "prepare" { s += $2 } END { print s + 0 }' \
    "$OUT/times.tsv" 2>/dev/null || echo 0)
  minutes=$(awk -v total="$TOTAL_MINUTES" -v spent="$spent" -v reserve="$EVAL_RESERVE_MINUTES" \
    'BEGIN { printf "%.2f", total - spent / 60 - reserve }')
  if awk -v m="$minutes" 'BEGIN { exit !(m < 1) }'; then
    echo "TOTAL_MINUTES=$TOTAL_MINUTES leaves $minutes training minutes after $(( spent / 60 )) minutes of data and" \
      "EVAL_RESERVE_MINUTES=$EVAL_RESERVE_MINUTES: raise TOTAL_MINUTES, lower REGEN_MINUTES or set TRAIN_MINUTES" >&2
    return 2
  fi
  echo "training budget: $minutes minutes (TOTAL_MINUTES $TOTAL_MINUTES, less $(awk -v s="$spent" \
    'BEGIN { printf "%.1f", s / 60 }') of data stages and $EVAL_RESERVE_MINUTES kept for the eval)" >&2
  echo "$minutes" > "$kept"
  echo "$minutes"
}

final_draft() {  # name: the run's final checkpoint's drafter, or nothing while it is unfinished
  python3 -c "import sys; from pathlib import Path; from dflash_train.demo import final_checkpoint
found = final_checkpoint(Path(sys.argv[1])); print(found / 'draft' if found else '')" "$OUT/train/$1"
}

eval_b16() {  # name, drafter, prompts per set, more flags: τ, speedup (and the exact check) at batch 1 in bf16, once
  [[ -f "$OUT/eval/$1-b16.json" ]] && return 0
  # shellcheck disable=SC2086  # EVAL_EXTRA is a list of flags
  run "${DFLASH[@]}" eval --target "$TARGET" --draft "$2" --dataset humaneval --dataset mt-bench \
    --dataset math-synthetic --num-prompts "$3" --max-new-tokens "$EVAL_NEW_TOKENS" --no-progress $EVAL_EXTRA \
    "${@:4}" --out "$OUT/eval/$1-b16.json"
}

prepared_first() {  # the curve and ablate stages train on $OUT/prepared: made here if the answers are there but
  # a stopped call never prepared them, its seconds in this stage's (with no answers either, training's own error
  # says what to run)
  [[ -f "$OUT/prepared/dflash_data.json" || ! -d "$OUT/regen" ]] && return 0
  prepare
}

curve() {
  # τ against training minutes: one run per budget in CURVE_MINUTES, each with its own schedule (a cut-short
  # longer run would not have annealed), each evaluated like main; the main run is a point too.
  local minutes draft
  prepared_first
  mkdir -p "$OUT/eval"
  for minutes in $CURVE_MINUTES; do
    train_run "curve-${minutes}min" "$minutes"
    draft=$(final_draft "curve-${minutes}min")
    [[ -n "$draft" ]] || { echo "curve-${minutes}min has not finished: run the curve stage again" >&2; return 1; }
    # The main run shows losslessness; a curve point needs only τ and the speedup. The target alone decodes
    # the same prompts for every point: once, then read from the cache (the main eval decodes its own).
    eval_b16 "curve-${minutes}min" "$draft" "$CURVE_PROMPTS" --no-lossless-check --target-cache "$OUT/eval/target-cache"
  done
  run python3 -m recipes.scoring.curve "$OUT"
}

ablate() {
  # Recipe changes judged at equal GPU-minutes: a baseline run and one run per ABLATIONS entry, ABLATION_MINUTES
  # each, on the same prepared data (so the same validation split), compared by held-out τ̂ per data source and
  # by the τ each decodes on ABLATION_EVAL_PROMPTS prompts per eval set (0: held-out τ̂ only).
  # Compilation is not counted in their minutes: a run that changes a shape compiles anew, the others reuse.
  local entry entries equal="$TRAIN_EXTRA training.time_budget_excludes_warmup=true"
  local CHECK_EVERY=$ABLATION_CHECK_EVERY  # a short run still draws its held-out τ̂ curve
  prepared_first
  mkdir -p "$OUT/eval"
  TRAIN_EXTRA="$equal" train_run ablation-base "$ABLATION_MINUTES"
  ablation_eval ablation-base
  IFS=';' read -ra entries <<< "$ABLATIONS"
  for entry in "${entries[@]}"; do
    TRAIN_EXTRA="$equal ${entry#*:}" train_run "ablation-${entry%%:*}" "$ABLATION_MINUTES"
    ablation_eval "ablation-${entry%%:*}"
  done
  IFS=';' read -ra entries <<< "$ABLATION_DATA"
  for entry in "${entries[@]}"; do  # data variants: the baseline recipe on the answers prepared another way
    # shellcheck disable=SC2086  # the entry's flags are a list
    prepare_into "$OUT/prepared-${entry%%:*}" ${entry#*:}
    TRAIN_EXTRA="$equal data.prepared=$OUT/prepared-${entry%%:*}" train_run "ablation-${entry%%:*}" "$ABLATION_MINUTES"
    ablation_eval "ablation-${entry%%:*}"
  done
  IFS=';' read -ra entries <<< "$ABLATION_REGEN"
  local name answers
  for entry in "${entries[@]}"; do  # answer variants: the baseline recipe on the prompts answered another way
    name=${entry%%:*} answers=
    [[ "$name" == *+ ]] && name=${name%+} answers="$OUT/regen"  # beside the stage's own answers
    # shellcheck disable=SC2086  # the entry's flags are a list
    regen_variant "$name" "$ABLATION_REGEN_MINUTES" ${entry#*:}
    ANSWERS="$answers $OUT/regen-$name" prepare_into "$OUT/prepared-$name"
    TRAIN_EXTRA="$equal data.prepared=$OUT/prepared-$name" train_run "ablation-$name" "$ABLATION_MINUTES"
    ablation_eval "ablation-$name"
  done
  # The table is kept as $OUT/ablations.md too: a time-limited call's log may keep only its last lines.
  run python3 -m recipes.scoring.compare "$OUT"/train/ablation-* --plot "$OUT/ablations.png" --evals "$OUT/eval" \
    | tee "$OUT/ablations.md"
  (( ABLATION_EVAL_PROMPTS > 0 )) || return 0
  local temperature
  for temperature in $(tr ',' '\n' <<< "$ABLATION_TEMPERATURES" | sort -g | tail -n +2); do  # past the lowest
    printf '\ndecoded τ at temperature %s:\n' "$temperature" | tee -a "$OUT/ablations.md"
    run python3 -m recipes.scoring.compare "$OUT"/train/ablation-* --evals "$OUT/eval" --temperature "$temperature" \
      | tee -a "$OUT/ablations.md"
  done
}

regen_variant() {  # name, minutes, more regenerate flags: the prompts answered again into $OUT/regen-NAME,
  # once, for those minutes (a call cut short starts them again: keep the variants to calls that hold them)
  local out="$OUT/regen-$1" loops=() seconds
  [[ -f "$out.done" || -f "$out.budget-spent" ]] && return 0
  [[ "$STOP_LOOPS" == 1 ]] && loops=(--stop-loops)
  seconds=$(awk -v minutes="$2" 'BEGIN { printf "%d", minutes * 60 }')
  # shellcheck disable=SC2086  # REGEN_EXTRA is a list of flags
  on_every_gpu timeout --foreground "${seconds}s" "${DFLASH[@]}" regenerate --target "$TARGET" --data "$PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-tokens 1024 --dtype bf16 --batch-size 4096 \
    --decode-rows "$DECODE_ROWS" "${loops[@]}" $REGEN_EXTRA "${@:3}" --out "$out" || {
    local code=$?
    [[ $code == 124 ]] || return $code
    echo "regeneration of $1 stopped after its $2 minutes: training on its shards" >&2
    touch "$out.budget-spent"
  }
  [[ -f "$out.budget-spent" ]] || touch "$out.done"
}

ablation_eval() {  # run name: its decoded τ (no lossless pass, which the main run shows), unless switched off
  (( ABLATION_EVAL_PROMPTS > 0 )) || return 0
  local draft; draft=$(final_draft "$1")
  [[ -n "$draft" ]] || { echo "$1 has not finished: run the ablate stage again" >&2; return 1; }
  # Runs are compared by decoded τ and by held-out τ̂ from training: the eval's own τ̂ is not needed.
  eval_b16 "$1" "$draft" "$ABLATION_EVAL_PROMPTS" --no-lossless-check --no-teacher-forced \
    --target-cache "$OUT/eval/target-cache" --temperature "$ABLATION_TEMPERATURES"
}

eval_b8() {  # drafter: at batch 8 the rows share each verify pass (the speedup at batch 8 too), once
  (( BATCH8_PROMPTS > 0 )) && [[ ! -f "$OUT/eval/main-b8.json" ]] || return 0
  run "${DFLASH[@]}" eval --target "$TARGET" --draft "$1" --dataset mt-bench --dataset humaneval \
    --num-prompts "$BATCH8_PROMPTS" --max-new-tokens "$(( EVAL_NEW_TOKENS / 2 ))" --batch-size 8 --no-progress \
    --out "$OUT/eval/main-b8.json"
}

eval_fp32() {  # drafter: float32 repeats the exact check at another precision, once
  [[ -f "$OUT/eval/main-fp32.json" ]] && return 0
  run "${DFLASH[@]}" eval --target "$TARGET" --draft "$1" --dataset mt-bench --dataset humaneval \
    --num-prompts "$FP32_PROMPTS" --max-new-tokens "$(( EVAL_NEW_TOKENS / 2 ))" --dtype float32 --no-compile --batch-size 8 \
    --no-progress --out "$OUT/eval/main-fp32.json"
}

eval_checks() {  # drafter: the headline eval, then the batch-8 and float32 ones; with GPUS > 1 side by side
  (( GPUS > 1 )) || {
    eval_b16 main "$1" "$EVAL_PROMPTS" --temperature "$EVAL_TEMPERATURES" && eval_b8 "$1" && eval_fp32 "$1"
    return; }
  # Each eval is one process on one GPU (LOCAL_RANK picks it), as a user decodes. The headline keeps GPU 0 to
  # itself, since its speedup is timed; the batch-8 eval (timed too) takes GPU 1, and the float32 check GPU 2,
  # or follows the batch-8 eval on GPU 1 when there are only two.
  local pids=() pid failed=0
  echo "+ the evals on $(( GPUS > 2 ? 3 : 2 )) GPUs, side by side" >&2
  (export LOCAL_RANK=0; eval_b16 main "$1" "$EVAL_PROMPTS" --temperature "$EVAL_TEMPERATURES") & pids+=($!)
  if (( GPUS > 2 )); then
    (export LOCAL_RANK=1; eval_b8 "$1") & pids+=($!)
    (export LOCAL_RANK=2; eval_fp32 "$1") & pids+=($!)
  else
    (export LOCAL_RANK=1; eval_b8 "$1" && eval_fp32 "$1") & pids+=($!)
  fi
  for pid in "${pids[@]}"; do
    wait "$pid" || failed=$?
  done
  return "$failed"
}

evaluate() {
  local draft=${EVAL_DRAFT:-}
  if [[ -n "$draft" ]]; then
    [[ -f "$draft/config.json" ]] || {
      echo "EVAL_DRAFT=$draft holds no config.json: give a drafter's folder (a checkpoint's draft/ or an export)" >&2
      return 2; }
  else
    draft=$(final_draft main)
    [[ -n "$draft" ]] || { echo "training has not finished: run the train stage again" >&2; return 1; }
  fi
  mkdir -p "$OUT/eval"
  eval_checks "$draft"
  run "${DFLASH[@]}" export "$draft" --target "$TARGET" --eval-report "$OUT/eval/main-b16.json" --overwrite \
    --out "$OUT/export"
  run "${DFLASH[@]}" check "$OUT/export" --target "$TARGET"
}

summary() {
  fold_cut_stage
  echo "minutes per stage ($OUT/times.tsv):"
  # The curve and ablate stages' runs are extra: they are not part of the speedrun's total. A stage run in parts
  # (resumed, or cut by a call's limit and run again) is one line with its parts' sum.
  awk -F '\t' '!($1 in seconds) { order[++stages] = $1 } { seconds[$1] += $2; parts[$1]++ }
    $1 != "curve" && $1 != "ablate" { total += $2 }
    END { for (i = 1; i <= stages; i++) { name = order[i]
            printf "  %-10s %6.1f%s\n", name, seconds[name] / 60, (parts[name] > 1 ? "  (" parts[name] " parts)" : "") }
          printf "  %-10s %6.1f\n", "total", total / 60 }' "$OUT/times.tsv"
  local goal goals=()
  for goal in $GOALS; do goals+=(--goal "$goal"); done
  python3 -m recipes.scoring.summary "$OUT" "${goals[@]}"
}

prompts_first() {  # regenerate and data need the prompts stage's file: said before the target is loaded
  regen_finished && return 0
  [[ "$PROMPTS" != "$OUT/prompts.jsonl" || -f "$PROMPTS" ]] && return 0
  echo "no prompts at $PROMPTS: run the prompts stage first (bash $0 prompts), or set PROMPTS to a prompt file" >&2
  exit 2
}

case "$STAGE" in
  prompts) timed prompts prompts ;;
  regenerate) prompts_first; timed regenerate regen ;;
  prepare) timed prepare prepare ;;
  data) prompts_first; timed regenerate regen; timed prepare prepare ;;
  train) timed train train ;;
  eval) timed eval evaluate ;;
  curve) timed curve curve ;;
  ablate) timed ablate ablate ;;
  summary) summary ;;
  all)  # one statement each: a function called inside an && list would run without set -e
    timed prompts prompts; timed regenerate regen; timed prepare prepare; timed train train; timed eval evaluate; summary ;;
  *) echo "unknown stage $STAGE: use all, prompts, regenerate, prepare, data, train, eval, curve, ablate or summary" >&2
     exit 2 ;;
esac
