"""Acceptance-length evaluation with a fast, lossless DFlash verify loop (`dflash-train eval`).

- The decode loop is the runtime's (`dflash_train.runtime`): static caches, device-side accept/stop, CUDA
  graphs, batched requests.
- `prompts`, `math_prompts`, `chat`: prompt sets and their chat formatting.
- `run`, `metrics`, `report`, `plot`, `console`: an evaluation run and its outputs.
"""
