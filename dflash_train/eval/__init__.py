"""Acceptance-length evaluation with a fast, lossless DFlash verify loop (`dflash-train eval`).

- The decode loop is the runtime's (`dflash_train.runtime`): static caches, device-side accept/stop, CUDA
  graphs, batched requests.
- The prompt sets are `dflash_train.prompts.eval_sets`; their prompt ids and stop tokens
  `dflash_train.data.prompt_ids`.
- `teacher_forced`, `target_pass_cache`, `compat`: teacher-forced acceptance, the cached target passes it
  reuses, and the drafter-target compatibility checks.
- `run`, `metrics`, `report`, `plot`, `console`: an evaluation run and its outputs.
- `marginal_oracle`, `marginal_ceiling`: the τ at a temperature of a drafter that is the target's own marginal,
  the best a drafter fitted to the target's distribution does drafting a block's slots independently
  (`python -m dflash_train.eval.marginal_ceiling`).
"""
