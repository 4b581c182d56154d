set -u
# The marginal oracle's τ (dflash_train/eval/marginal_ceiling.py) on a 2-core CPU: one process per temperature,
# one thread each (on 2 cores, two such processes decoded more in all than one process of 2 threads).
OUT=${OUT:-docs/results/marginal-ceiling-cpu}
for T in 0.7 1; do
  OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m dflash_train.eval.marginal_ceiling --target smollm2-135m-instruct \
    --prompts humaneval,mt-bench,math-synthetic --num-prompts 10 --max-new-tokens 128 --temperature $T \
    --samples 32 --block-size 16 --seed 0 --dtype float32 --device cpu \
    --output $OUT/T$T.json > $OUT/T$T.log 2>&1 &
done
wait
# T = 1 on all 20 conversations of each set (T1-20-*.json): MT-Bench alone in one process (40 turns), the
# other two sets in the other.
for P in mt-bench humaneval,math-synthetic; do
  OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m dflash_train.eval.marginal_ceiling --target smollm2-135m-instruct \
    --prompts $P --num-prompts 20 --max-new-tokens 128 --temperature 1 --samples 32 --block-size 16 --seed 0 \
    --dtype float32 --device cpu --no-progress --output $OUT/T1-20-$(echo $P | tr ',' '_').json &
done
wait
# T = 0.7 on all 20 conversations of each set (T0.7-20-*.json), the same split into two processes.
for P in mt-bench humaneval,math-synthetic; do
  OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m dflash_train.eval.marginal_ceiling --target smollm2-135m-instruct \
    --prompts $P --num-prompts 20 --max-new-tokens 128 --temperature 0.7 --samples 32 --block-size 16 --seed 0 \
    --dtype float32 --device cpu --no-progress --output $OUT/T0.7-20-$(echo $P | tr ',' '_').json &
done
wait
