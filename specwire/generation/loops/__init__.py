"""The decoding loops: `generate` (entry points), `sample`, `beam` and `speculative`."""
