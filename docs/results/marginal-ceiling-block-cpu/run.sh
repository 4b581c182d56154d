set -u
# The marginal oracle's τ at T = 1 with block verification (dflash_train/eval/marginal_ceiling.py
# --verification block) on a 2-core CPU, on the same 10 conversations a set as ../marginal-ceiling-cpu/T1.json:
# MT-Bench in one single-thread process, HumanEval and the math set in the other.
OUT=${OUT:-docs/results/marginal-ceiling-block-cpu}
for P in mt-bench humaneval,math-synthetic; do
  OMP_NUM_THREADS=1 .venv/bin/python -m dflash_train.eval.marginal_ceiling --target smollm2-135m-instruct \
    --prompts $P --num-prompts 10 --max-new-tokens 128 --temperature 1 --samples 32 --block-size 16 --seed 0 \
    --dtype float32 --device cpu --verification block --no-progress \
    --output $OUT/T1-block-$(echo $P | tr ',' '_').json &
done
wait
