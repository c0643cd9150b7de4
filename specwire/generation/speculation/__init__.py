"""Speculative decoding's parts: acceptance rules, drafters, prompt lookup, draft schedules and statistics."""
