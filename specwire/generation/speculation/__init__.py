"""Speculative decoding's parts: acceptance rules, drafters (the early-exit draft among them), prompt lookup, draft
schedules and statistics."""
