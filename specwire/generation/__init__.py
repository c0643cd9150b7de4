"""The generation core: transformers' `generate()` semantics in pure torch (no gRPC, no threads).

Its parts, in the order a request meets them:

- `config`: `GenerationConfig` and its validation; `argument_errors`: the errors callers get.
- `planning`: `prepare_generation` resolves a config against the prompts into a `GenerationPlan`.
- `rows`: the model-side state of a batch of rows (`Rows`: `RowBatch`, `RaggedRows`; the target
  service's `specwire.runtime.slot_cache.SlotRows` implements it too); `compilation`: when a
  static-cache request's decoding steps run through `torch.compile` (transformers' rule).
- `processors/`: logits processors and warpers; `stopping`: stopping criteria; `sampling`: token
  selection (greedy, multinomial), for the loops and the drafters alike.
- `loops/`: `generate` (`iter_generate`), the sample and beam loops (`sample`, `beam`, with
  `beam_search`), and `speculative` (`iter_speculative`: draft, verify, accept).
- `speculation/`: `acceptance` (greedy, rejection sampling, the cut at stops), `drafters`,
  `early_exit` (the target's first layers as its own draft), `mtp` (the target's multi-token prediction
  layers, fed its hidden states), `dflash` (a DFlash assistant fed the target's hidden states at chosen
  layers), `prompt_lookup`, `schedules` and `stats`.
- `outputs`: `StepEvent`, `GenerationResult`, transition scores.
"""
