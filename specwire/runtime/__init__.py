"""Model runtime pieces that lean on transformers internals, kept out of the pure generation core.

- `slot_cache`: a KV cache of fixed slots shared by many requests, packed forwards over it through
  transformers' attention interface, and `SlotRows`, the rows the decoding loops drive over it.
- `lean_decoder`: a Llama-layout forward as plain torch calls (bitwise the model's logits) for packed
  steps; on float32 CPU weights, blocks of 2-4 tokens are computed as one-token forwards round them,
  at about a one-token forward's cost.

The target service's batched scheduler uses both; `specwire.generation` never imports this package.
"""
