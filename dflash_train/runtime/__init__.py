"""The static-cache target runtime, shared by regeneration and evaluation.

Regeneration is the runtime without a drafter (`dflash_train.regeneration.generation.Generator`); evaluation runs it with one, and
without one for its baseline (`engine.DecodeEngine`).

- `config`: the settings (`EngineConfig`), defined once; kernel choice `auto|triton|torch`; stop ids.
- `static_target`: the target layer by layer over a static KV cache (Llama, Mistral, Qwen2, Qwen3), with
  fused projections (`fused_layer`) and the split-key attention kernel on decode and verify steps; its
  forward pass is `target_forward`'s, the attention its layers call over the cache `cache_attention`'s.
- `static_draft`: the drafter over its static context cache.
- `engine`: the decode loop: decisions on the device, CUDA graphs, rows refilled in prefill waves; the
  cycle's warm-up and CUDA graph are `cycle_graph`'s, requests, waves and the host's loop `scheduling`'s.
- `state`: per-row state on the device; `sampling`: greedy, seeded per-request draws, top-p, speculative
  rejection sampling.
- `loop_stop`: finishing a row stuck in a verbatim loop; `hf_cache`: Hugging Face KV-cache calls across
  transformers versions.
- `reference_loop`: the plain greedy verify loop over Hugging Face forwards, the semantics the engine
  reproduces (and the tests' reference).
"""
