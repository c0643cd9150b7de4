"""DoLa decoding (arXiv 2309.03883), as transformers 4.55.4's `_dola_decoding`.

Greedy search or sampling whose next-token logits contrast the final layer with an earlier
("premature") layer read through the LM head: `log_softmax(final) - log_softmax(premature)`, on the
tokens whose final probability is at least a tenth of the best one (`-inf` elsewhere). With several
candidate layers, the premature layer of a step is the one whose distribution is furthest (Jensen-Shannon
divergence, averaged over the batch) from the final one.

`dola_layers` picks the candidates: `"low"` the lower half, `"high"` the upper half (every second layer,
at most 20 layers' span; layer 0 is the embeddings, skipped when the LM head is tied to them), or a list
of layer indices (those past the last layer are dropped). transformers 5 moved DoLa to a Hub
`custom_generate` repository; 4.55.4's outputs are the contract (tests/parity/goldens). The processors
see the contrasted logits; `output_logits` keeps the final layer's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from specwire.generation.rows import RowBatch

__all__ = ["DolaContrast", "candidate_layers"]


def candidate_layers(dola_layers: Any, num_layers: int, tied_embeddings: bool) -> list[int]:
    """
    The candidate premature layers for `dola_layers`.

    Args:
        dola_layers (`str` or `list[int]`): `"low"`, `"high"` or layer indices.
        num_layers (`int`): the model's hidden layers.
        tied_embeddings (`bool`): whether the LM head shares the input embeddings.

    Returns:
        `list[int]`: hidden-state indices (0 is the embeddings).
    """
    if not tied_embeddings:
        start = 0
    elif num_layers > 2:
        start = 2
    elif num_layers == 2:
        start = 1
    else:
        start = 0
    if dola_layers == "low":
        if start == num_layers // 2:
            return [start]
        return list(range(start, num_layers // 2, 2)) if num_layers <= 40 else list(range(start, 20, 2))
    if dola_layers == "high":
        return (
            list(range(num_layers // 2, num_layers, 2))
            if num_layers <= 40
            else list(range(num_layers - 20, num_layers, 2))
        )
    if isinstance(dola_layers, list):
        return [i for i in dola_layers if i < num_layers]
    raise ValueError(f"dola_layers must be 'low', 'high' or a list of layer indices, got {dola_layers!r}")


def _relative_top_filter(
    scores: torch.Tensor, baseline: torch.Tensor, relative_top: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions as log-probabilities, `-inf` / `-1e-3` where the final one is below `relative_top`
    times its best probability."""
    scores_normalized = scores.log_softmax(dim=-1)
    baseline_normalized = baseline.log_softmax(dim=-1)
    sorted_logits, _ = torch.sort(scores_normalized, descending=True)
    min_thresh = sorted_logits[..., 0]
    probs_thresh = torch.max(scores_normalized, dim=-1).values + math.log(relative_top)
    probs_thresh = torch.min(min_thresh, probs_thresh).unsqueeze(-1)
    below = scores_normalized < probs_thresh
    baseline_normalized[below] = -1e-3
    scores_normalized[below] = -float("inf")
    return scores_normalized, baseline_normalized


def _contrast(layers: list[int], premature: dict[int, torch.Tensor], final_logits: torch.Tensor) -> torch.Tensor:
    """transformers 4.55.4's `_dola_select_contrast`."""
    if len(layers) == 1:
        chosen = layers[0]
    else:
        stacked = torch.stack([premature[i] for i in layers], dim=0)  # [layers, rows, V]
        softmax_final = F.softmax(final_logits, dim=-1)
        softmax_premature = F.softmax(stacked, dim=-1)
        average = 0.5 * (softmax_final[None, :, :] + softmax_premature)
        kl_final = F.kl_div(F.log_softmax(final_logits, dim=-1)[None, :, :], average, reduction="none").mean(-1)
        kl_premature = F.kl_div(F.log_softmax(stacked, dim=-1), average, reduction="none").mean(-1)
        js_divergences = (0.5 * (kl_final + kl_premature)).mean(-1)  # [layers]
        chosen = layers[int(js_divergences.argmax().item())]
    final, base = _relative_top_filter(final_logits, premature[chosen])
    return final - base


class DolaContrast:
    """
    Turns a step's final logits into DoLa's contrasted logits, reading the step's hidden states from the rows.

    Args:
        model (`PreTrainedModel`): the model (its LM head and layer count).
        dola_layers (`str` or `list[int]`): the config's `dola_layers`.
        rows (`RowBatch`): rows built with `output_hidden_states=True`.
        keep_hidden_states (`bool`): the caller returns the hidden states; otherwise each step's are dropped.
    """

    def __init__(self, model: Any, dola_layers: Any, rows: RowBatch, keep_hidden_states: bool):
        config = model.config
        text_config = config.get_text_config()
        tied = bool(getattr(config, "tie_word_embeddings", getattr(text_config, "tie_word_embeddings", False)))
        self.layers = candidate_layers(dola_layers, int(text_config.num_hidden_layers), tied)
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError("DoLa needs a model with output embeddings (an LM head)")
        self.rows = rows
        self.keep_hidden_states = keep_hidden_states

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The contrasted logits `[rows, V]` of the step whose final logits are `logits` `[rows, V]`."""
        hidden = self.rows.hidden_states[-1] if self.keep_hidden_states else self.rows.hidden_states.pop()
        with torch.no_grad():
            premature = {layer: self.lm_head(hidden[layer][:, -1, :]).to(logits.device) for layer in self.layers}
            return _contrast(self.layers, premature, logits)
