"""Acceptance-length evaluation with a fast, lossless DFlash verify loop (`dflash-train eval`).

- `engine`: the decode loop (static caches, device-side accept/stop, CUDA graphs, batched requests);
  `static_target` / `static_draft` / `state` / `sampling` are its parts.
- `prompts`, `math_prompts`, `chat`: prompt sets and their chat formatting.
- `run`, `metrics`, `report`, `plot`, `console`: an evaluation run and its outputs.
"""
