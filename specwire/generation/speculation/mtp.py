"""Multi-token prediction (`use_mtp`): the target's own MTP layers draft from its last hidden states.

A checkpoint with MTP layers (`config.num_mtp_layers`: DeepSeek-V3, GLM-4.5, ...) stores, after its decoder
layers, `L` small blocks that each predict one more token from the previous block's hidden states and the
embedding of the token before. transformers loads them as an `MtpModel` (sharing the target's embedding, LM
head and rotary embedding) and drafts with `MTPCandidateGenerator`; `MtpDrafter` drafts as that generator does,
per row, calling the library's `MtpModel.forward_layer` (the per-layer step transformers exposes for frameworks
that own the drafting loop) with one `MtpCache` per row:

- The first round drafts nothing: the MTP layers need the target's hidden states of the prompt, which its first
  forward gives (specwire's first token comes from that prefill anyway, so drafting starts at the next round).
- Each round feeds the MTP layers the target's last-layer hidden states of the positions it verified and kept
  (the last emitted token's position excluded: the target has not run it yet), paired with the tokens shifted
  by one, and runs the `L` layers once: layer `i` drafts token `i + 1` (all `L` tokens every round, as
  transformers does; the loop verifies the first ones it asked for).
- Cache correction: layers after the first also cached the drafts they were fed; when fewer than `L - 1` drafts
  were accepted, the last `L` positions of every layer are cropped and recomputed with the accepted tokens and
  the target's kept hidden states (`MTPCandidateGenerator`'s rule).

The hidden states come from the speculative loop's rows (`RowBatch(keep_last_hidden_states=True)`), handed to
the drafter once by `bind_hidden_states`. The drafts' processors and sampling are those of the other model
drafters (`drafters._draft_processors`; the drafter's own random stream when sampling), so speculative sampling
keeps the target's distribution and greedy output is plain greedy output.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from specwire.generation.sampling import greedy_tokens
from specwire.generation.speculation.drafters import DraftFailure, Proposal, _draft_processors

__all__ = ["HiddenStates", "MtpDrafter", "bind_hidden_states", "mtp_layer_count", "open_mtp_drafter"]


class HiddenStates(Protocol):
    """Where the drafter reads the target's last-layer hidden states (`RowBatch` with `keep_last_hidden_states`):
    those of the latest prefill (one tensor per chunk) or verify forward, each `[rows, positions, hidden]`, and
    the rows' attention mask (`None` without padding), which says which prefill positions are real tokens."""

    last_hidden_states: list[torch.Tensor]
    attention_mask: torch.Tensor | None


def mtp_layer_count(model: Any) -> int | None:
    """The model's `num_mtp_layers` (its text config's), or None when its config has none."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_mtp_layers", None)
    return int(count) if count else None


def bind_hidden_states(drafter: Any, source: HiddenStates) -> None:
    """Give `drafter` the rows whose hidden states it drafts from, if it drafts from hidden states."""
    bind = getattr(drafter, "bind_hidden_states", None)
    if bind is not None:
        bind(source)


class _Row:
    """One row's MTP state: its tokens, its `MtpCache`, and the target hidden states of its positions.

    Positions `[0, ran)` are those the target ran (their hidden states arrived), `[0, fed)` those the MTP
    layers ran (their caches hold them); drafting needs `ran == len(tokens) - 1` (only the newest token unrun).
    """

    def __init__(self, tokens: list[int], cache: Any):
        self.tokens = tokens
        self.cache = cache
        self.ran = 0
        self.fed = 0
        self.pending: list[torch.Tensor] = []  # [1, n, hidden] pieces of positions [fed, ran)
        # [1, n, hidden]: the last hidden states up to `ran` (two or more MTP layers: a correction reruns them)
        self.history: torch.Tensor | None = None
        self.stale = False  # drafts fed to layers > 0 were rejected: recompute the last positions first
        self.drafted: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.finished = False

    def receive(self, hidden: torch.Tensor, keep_history: bool) -> None:
        """The target's hidden states `[1, n, hidden]` of the next `n` positions."""
        self.pending.append(hidden)
        self.ran += hidden.shape[1]
        if keep_history:
            self.history = hidden if self.history is None else torch.cat([self.history, hidden], dim=1)


class FedByHiddenStates:
    """What the MTP and DFlash drafters share: the target's hidden states they are fed (`bind_hidden_states`)
    and the prefill's prompt positions taken from them. A subclass sets `rows` (`_Row`s), `device`,
    `source = None` and `prefilled = False`."""

    rows: list[_Row]
    device: Any
    source: HiddenStates | None
    prefilled: bool

    def _keeps_for_correction(self) -> bool:
        """Whether a row keeps the hidden states it received for a later cache correction."""
        return False

    def bind_hidden_states(self, source: HiddenStates) -> None:
        """Read the target's hidden states from `source`; a prefill it already ran is taken now."""
        self.source = source
        if source.last_hidden_states:
            self._take_prefill()

    def _latest(self) -> torch.Tensor:
        """The latest forward's kept hidden states `[rows, positions, features]` (a chunked prefill's chunks
        joined)."""
        return torch.cat(cast(HiddenStates, self.source).last_hidden_states, dim=1).to(self.device)

    def _take_prefill(self) -> None:
        """Each row's prompt positions of the prefill (those the mask keeps, or the last ones): every token but
        the newest, which the loop took from the prefill's logits."""
        hidden = self._latest()  # [rows, padded prompt, features]
        mask = cast(HiddenStates, self.source).attention_mask
        keep = self._keeps_for_correction()
        for r, row in enumerate(self.rows):
            prompt = len(row.tokens) - 1
            if prompt <= 0 or row.finished:
                continue
            if mask is None:
                row.receive(hidden[r : r + 1, hidden.shape[1] - prompt :], keep)
            else:
                row.receive(hidden[r][mask[r, : hidden.shape[1]].to(hidden.device).bool()][None], keep)
        self.prefilled = True


class MtpDrafter(FedByHiddenStates):
    """Drafts `num_mtp_layers` tokens per row and round with the target's MTP layers (see the module docstring).

    Args:
        mtp (`MtpModel`): the served model's MTP layers (`specwire.models.mtp_layers.mtp_model_for`).
        rows (`list[list[int]]`): each row's tokens so far (prompt without padding, and the first token when the
            loop took it from the prefill).
        config (`GenerationConfig`): the request's effective config (`do_sample`, processors).
        vocab_size (`int`): the target's vocabulary size (width of the loop's scores).
        return_probs (`bool`): return the drafts' probabilities (the target samples, or mixes an ensemble).
        generator (`torch.Generator`, *optional*): randomness of the drafts' sampling.
    """

    def __init__(
        self,
        mtp: Any,
        rows: list[list[int]],
        config: Any,
        vocab_size: int,
        return_probs: bool,
        generator: torch.Generator | None = None,
    ):
        from transformers.cache_utils import MtpCache

        self.mtp = mtp
        self.layers = len(mtp.layers)
        self.vocab_size = vocab_size
        self.do_sample = bool(config.do_sample)
        self.return_probs = return_probs
        self.generator = generator
        self.device = next(mtp.layers.parameters()).device
        self.processors = [_draft_processors(config, r, vocab_size) for r in rows]
        self.rows = [_Row(list(r), MtpCache(config=mtp.config)) for r in rows]
        self.source: HiddenStates | None = None
        self.prefilled = False  # the prefill's hidden states were taken

    def _keeps_for_correction(self) -> bool:
        return self.layers > 1

    @torch.inference_mode()
    def propose(self, num_tokens: int) -> Proposal:
        if self.source is None:
            raise DraftFailure("the MTP drafter was given no hidden states of the target (its rows were not bound)")
        tokens: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for i, row in enumerate(self.rows):
            row.drafted, row.probs = [], []
            # Until the loop emitted a token after the prefill there is nothing to draft from (transformers'
            # first iteration, which drafts nothing).
            if not row.finished and num_tokens > 0 and row.ran == len(row.tokens) - 1 and row.ran > row.fed:
                self._draft_row(i, row)
            drafted = row.drafted[:num_tokens]
            tokens.append(drafted)
            probs.append(torch.stack(row.probs[: len(drafted)]) if drafted and self.return_probs else None)
        return Proposal(tokens, probs)

    def _draft_row(self, i: int, row: _Row) -> None:
        """Run the `L` MTP layers once on the row's new positions, drafting one token each."""
        hidden = torch.cat(row.pending, dim=1)  # [1, ran - fed, hidden]
        if row.stale and row.history is not None:
            # transformers' correction: every layer forgets its last L positions, recomputed with the accepted
            # tokens (layers > 0 had cached the drafts they were fed). Never more than the cache holds.
            back = min(self.layers, row.fed)
            row.cache.crop(-back)
            hidden = row.history[:, -(hidden.shape[1] + back) :]
        start = row.ran - hidden.shape[1] + 1  # position of the token paired with the first hidden state
        ids = torch.tensor([row.tokens[start : row.ran + 1]], dtype=torch.long, device=self.device)
        positions = torch.arange(start, row.ran + 1, device=self.device)[None]
        context = list(row.tokens)
        for layer in range(self.layers):
            hidden = self.mtp.forward_layer(layer, hidden, positions, row.cache, input_ids=ids)
            # The library's own projection (shared LM head, muP scaling, unpadded vocabulary), last position only.
            logits = self.mtp._project_to_logits(hidden[:, -1:])[:, -1].float()  # [1, head vocab]
            scores = self.processors[i](torch.tensor([context], device=self.device), _fit(logits, self.vocab_size))
            if self.do_sample:
                token = int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))
            else:
                token = int(greedy_tokens(scores))
            if self.return_probs:
                row.probs.append(scores.softmax(-1)[0])
            row.drafted.append(token)
            context.append(token)
            ids = torch.cat([ids[:, 1:], ids.new_tensor([[token]])], dim=-1)
            positions = torch.cat([positions[:, 1:], positions[:, -1:] + 1], dim=-1)
        row.pending, row.fed, row.stale = [], row.ran, False
        if row.history is not None:  # a correction reruns at most the last L positions before the new ones
            row.history = row.history[:, -self.layers :].clone()  # (a copy: the slice would keep the rest)

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        """The rows' outcomes, then the hidden states of the positions each kept (those the target verified)."""
        verified = None
        if self.source is not None and self.source.last_hidden_states and self.prefilled:
            verified = self._latest()  # [rows, k + 1, hidden]: the last token and the block
        for r, row in enumerate(self.rows):
            if row.finished:
                continue
            kept = row.drafted[: num_accepted[r]]
            row.tokens += kept + list(appended[r])
            # Drafts fed to the later layers were rejected: those layers' caches hold wrong tokens.
            row.stale = row.stale or (bool(row.drafted) and self.layers > 1 and num_accepted[r] < self.layers - 1)
            row.drafted, row.probs = [], []
            if finished[r]:
                row.finished, row.pending, row.history = True, [], None
            elif verified is not None:
                # The positions of the last token and the accepted drafts; the token after them is unrun.
                row.receive(verified[r : r + 1, : len(row.tokens) - 1 - row.ran], self.layers > 1)

    def close(self) -> None:
        self.rows = []
        self.source = None


def _fit(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[1, head vocab]` cut or padded (with -inf) to the target's vocabulary size, as the loop's scores are."""
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[:, :vocab_size]
    if width < vocab_size:
        return torch.cat([logits, logits.new_full((1, vocab_size - width), float("-inf"))], dim=-1)
    return logits


def open_mtp_drafter(mtp: Any, rows: list[list[int]], config: Any, vocab_size: int, return_probs: bool) -> MtpDrafter:
    """An `MtpDrafter` with its own random stream when the request samples (as `open_model_drafter`).

    Args:
        mtp (`MtpModel`): the served model's MTP layers.
        rows (`list[list[int]]`): each row's tokens so far.
        config (`GenerationConfig`): the request's effective config (`do_sample`, `seed`, processors).
        vocab_size (`int`): the target's vocabulary size.
        return_probs (`bool`): return the drafts' probabilities.
    """
    generator = None
    if config.do_sample:
        generator = torch.Generator(device=next(mtp.layers.parameters()).device)
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()
    return MtpDrafter(mtp, rows, config, vocab_size, return_probs, generator)
