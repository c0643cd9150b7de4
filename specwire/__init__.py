"""specwire: speculative text generation as gRPC services with transformers generate() semantics."""
