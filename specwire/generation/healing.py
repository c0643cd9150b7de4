"""Token healing (`token_healing=True`), as transformers' `GenerationMixin.heal_tokens` does it.

The prompt rows are decoded, stripped and re-tokenized; each row's last token is then replaced by the
model's greedy choice among the vocabulary tokens that extend it (a +10 bias on every extension, +1
more on the original token), computed from the row without that token. Generation then proceeds from
the healed prompt as usual, so speculation after healing stays exact.
"""

from __future__ import annotations

from typing import Any

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument

_EXTENSION_BIAS = 10.0
_ORIGINAL_BONUS = 1.0  # transformers slightly favours the original token ('http' should stay 'http')


def heal_prompts(model: Any, tokenizer: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """
    Heal each prompt row's tail token.

    Args:
        model (`PreTrainedModel`):
            The causal LM that picks each row's healed tail.
        tokenizer (`PreTrainedTokenizerBase`):
            The model's tokenizer (its vocabulary gives the extensions).
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
            The prompts, left padded.

    Return:
        `torch.LongTensor`: the healed prompts, re-tokenized (possibly another length) with BOS replaced by
        the pad token, as transformers returns them.
    """
    if tokenizer is None:
        raise InvalidGenerationArgument.for_field(
            "token_healing", True, "token healing needs the model's tokenizer and this model has none; unset it"
        )
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    prompts = [p.strip() for p in tokenizer.decode(input_ids, skip_special_tokens=True)]
    ids = tokenizer(prompts, return_tensors="pt", padding=True).input_ids.to(input_ids.device)
    ids = torch.where(ids == bos, pad, ids)  # healing is not conditioned on BOS
    if ids.numel() == 0:
        return ids
    vocab = tokenizer.get_vocab()
    tail_ids = ids[:, -1].tolist()
    for row, tail_id in enumerate(tail_ids):
        row_ids = ids[row]
        if bool(torch.all(row_ids == pad)):
            continue
        biases = _extension_biases(tokenizer, vocab, tail_id)
        if len(biases) == 1:
            continue  # nothing but the token itself: nothing to heal with
        if tail_id not in biases:
            # transformers fails here (a KeyError): the decoded tail is not a prefix of its own token string.
            raise InvalidGenerationArgument.for_field(
                "token_healing",
                True,
                f"the prompt's last token {tail_id} ({tokenizer.decode(tail_id)!r}) cannot be healed with this "
                "tokenizer (transformers fails on it too); unset token_healing or end the prompt differently",
            )
        biases[tail_id] += _ORIGINAL_BONUS
        trimmed = row_ids[:-1]
        if trimmed.numel() == 0:
            continue
        if int((row_ids != pad).sum()) == 1:
            trimmed[-1] = bos  # a one-token prompt is healed from BOS
        ids[row, -1] = _biased_greedy_token(model, trimmed, biases, pad)
    return ids


def heal_same_shape(model: Any, tokenizer: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """
    `heal_prompts`, refusing a healing that changes the prompts' length: transformers then goes on decoding
    the new prompts under the request's old attention mask, which specwire does not reproduce.

    Args:
        model, tokenizer, input_ids: as for `heal_prompts`.

    Return:
        `torch.LongTensor`: the healed prompts, same shape as `input_ids` (the attention mask stays valid).
    """
    healed = heal_prompts(model, tokenizer, input_ids)
    if healed.shape != input_ids.shape:
        raise InvalidGenerationArgument.for_field(
            "token_healing",
            True,
            f"healing re-tokenizes the stripped prompts to {healed.shape[1]} tokens instead of {input_ids.shape[1]} "
            "(leading/trailing whitespace or padding changed); strip whitespace from the prompts, or unset it",
        )
    return healed


def _extension_biases(tokenizer: Any, vocab: dict[str, int], tail_id: int) -> dict[int, float]:
    tail = tokenizer.decode(tail_id)
    space_id = tokenizer.convert_tokens_to_ids(" ")
    if space_id is not None:
        # As transformers: the first character of the token string that " " maps to stands for a space.
        tail = tail.replace(" ", tokenizer.convert_ids_to_tokens(space_id)[0])
    # transformers' vocabulary trie stops at the first character it lacks and extends from there: the
    # "extensions" are `tail` followed by the rest of every token under the longest matched prefix
    # (strings that are often no token at all, which then map to the unknown token's id).
    matched = next(n for n in range(len(tail), -1, -1) if n == 0 or _has_prefix(vocab, tail[:n]))
    stem = tail[:matched]
    extensions = {tail + token[matched:] for token in vocab if token.startswith(stem)}
    return {tokenizer.convert_tokens_to_ids(token): _EXTENSION_BIAS for token in extensions}


def _has_prefix(vocab: dict[str, int], prefix: str) -> bool:
    return any(token.startswith(prefix) for token in vocab)


@torch.no_grad()
def _biased_greedy_token(model: Any, row: torch.Tensor, biases: dict[int, float], pad: int) -> int:
    """transformers' one-token `generate(max_new_tokens=1, sequence_bias=...)` on one row: the attention mask is
    inferred from the pad token unless pad is an EOS token (then every position attends, as there)."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    row = row.to(model.device)  # the target prepares prompts on the CPU
    mask = (row != pad).long() if pad is not None and pad not in eos_ids else torch.ones_like(row)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = model(input_ids=row[None], attention_mask=mask[None], position_ids=positions[None]).logits
    scores = logits[0, -1].float().clone()
    for token, bias in biases.items():
        scores[token] += bias
    return int(scores.argmax())
