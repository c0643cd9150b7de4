"""A tokenizer's identity as a digest: a draft model's token ids must mean the target's tokens.

The target sends its digest when a draft stream opens (`DraftStart.tokenizer_digest`); the draft
service compares it with its own model's and refuses another vocabulary. Model heads may be wider than
the tokenizer (embeddings padded for speed), so the heads' widths say nothing; the vocabularies do.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["tokenizer_digest"]


def tokenizer_digest(tokenizer: Any) -> bytes:
    """SHA-256 of a tokenizer's vocabulary: its `get_vocab()` entries in id order (equal digests: the same
    token for every id, which is what `check_draft_model` compares for a co-located draft).

    Args:
        tokenizer (`PreTrainedTokenizerBase`): any tokenizer with `get_vocab()`.
    """
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        encoded = token.encode("utf-8", "surrogatepass")
        digest.update(index.to_bytes(8, "little") + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()
