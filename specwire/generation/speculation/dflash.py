"""DFlash (`speculation_type="dflash"`): a block-diffusion assistant drafts a block from the target's hidden states.

transformers' `DFlashTokenCandidateGenerator` drafts with an assistant model of a DFlash class (5.23 ships
`MuseGlimmerAssistantModel`: an `AutoModel` without LM head whose config names `target_layer_ids`, `block_size` and
`mask_token_id`). `DFlashDrafter` drafts as that generator does, per row, with one `DFlashCache` each:

- The first round drafts nothing: the assistant needs the target's hidden states of the prompt, which its first
  forward gives (specwire's first token comes from that prefill anyway, so drafting starts at the next round).
- Each round hands the assistant the target's hidden states at `target_layer_ids` (hidden-state index `i + 1`: index
  0 is the embeddings), concatenated on the feature axis, of the positions the target verified and kept (the newest
  token's position excluded: the target has not run it yet) as `context_hidden_states`; the cache is told how many
  (`set_previous_accepted_tokens`) and forgets the previous round's noise window (`crop(-block_size)`).
- One forward denoises a window of the newest token and `block_size - 1` mask tokens (embedded with the target's
  input embeddings, bypassing an embedding norm as transformers does); the target's LM head turns the window's last
  `block_size - 1` positions into candidates, the request's draft processors applied one position at a time.

The hidden states come from the speculative loop's rows (`RowBatch(keep_last_hidden_states=[...])`), handed to the
drafter once by `mtp.bind_hidden_states` (the same hook as the MTP drafter's). The drafts' processors and sampling
are those of the other model drafters (`drafters._draft_processors`; the drafter's own random stream when sampling),
so speculative sampling keeps the target's distribution and greedy output is plain greedy output.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from specwire.generation.sampling import greedy_tokens
from specwire.generation.speculation.drafters import DraftFailure, Proposal, _draft_processors
from specwire.generation.speculation.mtp import FedByHiddenStates, HiddenStates, _fit, _Row

__all__ = ["DFlashDrafter", "dflash_hidden_layers", "is_dflash_assistant", "open_dflash_drafter"]

# The config attributes that make an assistant a DFlash one (transformers reads them in its DFlash generator).
DFLASH_CONFIG_KEYS = ("target_layer_ids", "block_size", "mask_token_id")


def is_dflash_assistant(model: Any) -> bool:
    """Whether `model`'s config names `target_layer_ids`, `block_size` and `mask_token_id`."""
    return all(getattr(model.config, key, None) is not None for key in DFLASH_CONFIG_KEYS)


def dflash_hidden_layers(assistant: Any) -> list[int]:
    """The target's hidden-state indices the assistant reads (`target_layer_ids` + 1: index 0 is the embeddings)."""
    return [int(i) + 1 for i in assistant.config.target_layer_ids]


class DFlashDrafter(FedByHiddenStates):
    """Drafts `block_size - 1` tokens per row and round with a DFlash assistant (see the module docstring).

    Args:
        assistant (`PreTrainedModel`): the DFlash assistant (`specwire.models.dflash_assistant`).
        input_embeddings (`nn.Embedding`): the target's input embeddings (the noise window's embeddings).
        output_embeddings (`nn.Linear`): the target's LM head (the candidates' logits).
        rows (`list[list[int]]`): each row's tokens so far (prompt without padding, and the first token when the
            loop took it from the prefill).
        config (`GenerationConfig`): the request's effective config (`do_sample`, processors).
        vocab_size (`int`): the target's vocabulary size (width of the loop's scores).
        return_probs (`bool`): return the drafts' probabilities (the target samples, or mixes an ensemble).
        generator (`torch.Generator`, *optional*): randomness of the drafts' sampling.
    """

    def __init__(
        self,
        assistant: Any,
        input_embeddings: Any,
        output_embeddings: Any,
        rows: list[list[int]],
        config: Any,
        vocab_size: int,
        return_probs: bool,
        generator: torch.Generator | None = None,
    ):
        from transformers.cache_utils import DFlashCache

        self.assistant = assistant
        self.input_embeddings = input_embeddings
        self.output_embeddings = output_embeddings
        self.block_size = int(assistant.config.block_size)
        self.mask_token_id = int(assistant.config.mask_token_id)
        self.vocab_size = vocab_size
        self.do_sample = bool(config.do_sample)
        self.return_probs = return_probs
        self.generator = generator
        self.device = assistant.device
        self.processors = [_draft_processors(config, r, vocab_size) for r in rows]
        self.rows = [_Row(list(r), DFlashCache(config=assistant.config)) for r in rows]
        for row in self.rows:
            row.cache.activate_past_recording()
        self.noise = [False] * len(rows)  # the row's cache holds a noise window (cropped before the next)
        self.source: HiddenStates | None = None
        self.prefilled = False

    @torch.inference_mode()
    def propose(self, num_tokens: int) -> Proposal:
        if self.source is None:
            raise DraftFailure("the DFlash drafter was given no hidden states of the target (its rows were not bound)")
        tokens: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for i, row in enumerate(self.rows):
            row.drafted, row.probs = [], []
            # Until the loop emitted a token after the prefill there is nothing to draft from (transformers'
            # first iteration, which drafts nothing).
            if not row.finished and num_tokens > 0 and row.ran == len(row.tokens) - 1 and row.ran > row.fed:
                self._draft_row(i, row, num_tokens)
            drafted = row.drafted[:num_tokens]
            tokens.append(drafted)
            probs.append(torch.stack(row.probs[: len(drafted)]) if drafted and self.return_probs else None)
        return Proposal(tokens, probs)

    def _noise_embeds(self, noise_ids: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of the noise window, without an embedding norm (transformers bypasses it)."""
        norm = getattr(self.input_embeddings, "embed_norm", None)
        if norm is None:
            return cast(torch.Tensor, self.input_embeddings(noise_ids))
        try:
            self.input_embeddings.embed_norm = nn.Identity()
            return cast(torch.Tensor, self.input_embeddings(noise_ids))
        finally:
            self.input_embeddings.embed_norm = norm

    def _draft_row(self, i: int, row: _Row, num_tokens: int) -> None:
        """One assistant forward on the row's new context and noise window; `block_size - 1` candidates."""
        context = torch.cat(row.pending, dim=1)  # [1, ran - fed, hidden * layers]
        row.cache.set_previous_accepted_tokens(context.shape[1])
        if self.noise[i]:
            row.cache.crop(-self.block_size)  # the previous round's noise window
        embed_device = self.input_embeddings.weight.device
        noise_ids = torch.tensor([[row.tokens[-1]] + [self.mask_token_id] * (self.block_size - 1)], device=embed_device)
        positions = torch.arange(row.fed, row.ran + self.block_size, device=self.device)[None]
        # transformers passes the full (all-ones, batch of one) mask of the positions so far and the window.
        mask = torch.ones(1, row.ran + self.block_size, dtype=torch.long, device=self.device)
        outputs = self.assistant(
            noise_embeds=self._noise_embeds(noise_ids).to(self.device),
            context_hidden_states=context,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=row.cache,
        )
        head = self.output_embeddings
        logits = head(outputs.last_hidden_state[:, 1:].to(head.weight.device)).float()  # [1, block - 1, head vocab]
        history = list(row.tokens)
        for j in range(logits.shape[1]):
            ids = torch.tensor([history], device=logits.device)
            scores = self.processors[i](ids, _fit(logits[:, j], self.vocab_size))
            if self.do_sample:
                token = int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))
            else:
                token = int(greedy_tokens(scores))
            if self.return_probs:
                row.probs.append(scores.softmax(-1)[0])
            row.drafted.append(token)
            history.append(token)
            if len(row.drafted) >= num_tokens:  # the loop verifies no more (the rest would be cut anyway)
                break
        row.pending, row.fed, self.noise[i] = [], row.ran, True

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        """The rows' outcomes, then the hidden states of the positions each kept (those the target verified)."""
        verified = None
        if self.source is not None and self.source.last_hidden_states and self.prefilled:
            verified = self._latest()  # [rows, k + 1, hidden * layers]: the last token and the block
        for r, row in enumerate(self.rows):
            if row.finished:
                continue
            row.tokens += row.drafted[: num_accepted[r]] + list(appended[r])
            row.drafted, row.probs = [], []
            if finished[r]:
                row.finished, row.pending = True, []
            elif verified is not None:
                # The positions of the last token and the accepted drafts; the token after them is unrun.
                row.receive(verified[r : r + 1, : len(row.tokens) - 1 - row.ran], False)

    def close(self) -> None:
        self.rows = []
        self.source = None


def open_dflash_drafter(
    assistant: Any, target: Any, rows: list[list[int]], config: Any, vocab_size: int, return_probs: bool
) -> DFlashDrafter:
    """A `DFlashDrafter` over `target`'s embeddings and LM head, with its own random stream when the request samples.

    Args:
        assistant (`PreTrainedModel`): the DFlash assistant.
        target (`PreTrainedModel`): the served model (its input embeddings and LM head).
        rows (`list[list[int]]`): each row's tokens so far.
        config (`GenerationConfig`): the request's effective config (`do_sample`, `seed`, processors).
        vocab_size (`int`): the target's vocabulary size.
        return_probs (`bool`): return the drafts' probabilities.
    """
    generator = None
    if config.do_sample:
        generator = torch.Generator(device=assistant.device)
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()
    return DFlashDrafter(
        assistant,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        rows,
        config,
        vocab_size,
        return_probs,
        generator,
    )
