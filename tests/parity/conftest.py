"""Parity fixtures live in tests/conftest.py (the embedded SmolLM2 is shared by every test folder)."""
