"""The target's side of speculation: which drafter a request uses (`DraftPolicy`).

The remote drafter (`DraftChannel`, `RemoteDrafter`) is in `specwire.target_service.remote_drafter`.

Co-located draft (`--draft-model`, `DraftPolicy.draft_model`): `draft_model` requests get the draft
service's own `ModelDrafter` (`open_model_drafter`) over a draft model loaded in this process, no RPC,
as transformers' assisted generation drafts. Its forwards run where the target's do, with the process's
torch threads: posted to the batched scheduler's thread (`BatchScheduler.forward`, between packed
forwards) from the request's own thread (its lane thread in the lane), which runs the rest of `propose`
announced as a draft wait like a remote round; with the sequential scheduler on the model thread; never
the event loop. Not on the request's thread: it runs torch single-threaded (`specwire.model_thread`), and
there SmolLM2's int8 draft took ~38 ms a drafted token against ~30 on the scheduler's 2 threads (2-core
CPU, blocks of 20 on the low-acceptance prompt), and drafting did not pay. It excludes `--draft-address`
(refused at start: one draft model per target, no precedence to guess).

Self-speculation, always in this process: `early_exit` (`assistant_early_exit=N`) drafts with a view of
the target's first N layers; `mtp` (`use_mtp=True`) with the served model's multi-token prediction layers
(`models.mtp_layers.mtp_model_for`, loaded on the first such request), fed the target's last hidden states
by the speculative loop. MTP requests run in the batched scheduler's sequential lane (`routing`), with a
constant draft length of `num_mtp_layers` and no adaptive controller, as transformers drafts them.
`dflash` (`speculation_type="dflash"`) drafts with the DFlash assistant loaded at start (`--dflash-model`,
`models.dflash_assistant`), fed the target's hidden states at its `target_layer_ids` the same way; `block_size -
1` tokens a round, no adaptive controller, the sequential lane (`speculation_type` decides the refusals).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from specwire.deadline import caller_deadline
from specwire.errors import FieldProblem, InvalidArgument
from specwire.generation.speculation.controller import SpeculationController
from specwire.generation.speculation.costs import SharedCosts
from specwire.generation.speculation.dflash import dflash_hidden_layers, open_dflash_drafter
from specwire.generation.speculation.drafters import (
    Drafter,
    DraftFailure,
    ForwardRunner,
    PromptLookupDrafter,
    Proposal,
    open_model_drafter,
)
from specwire.generation.speculation.early_exit import early_exit_model
from specwire.generation.speculation.mtp import bind_hidden_states, mtp_layer_count, open_mtp_drafter
from specwire.generation.speculation.stats import SpeculationStats
from specwire.models.mtp_layers import mtp_model_for
from specwire.models.tokenizer_digest import tokenizer_digest
from specwire.runtime.lean_draft import lean_draft_forward
from specwire.security.channels import stays_on_this_machine
from specwire.target_service.remote_drafter import DraftChannel, RemoteDrafter
from specwire.target_service.speculation_type import dflash_proposer
from specwire.vocabulary import (
    PROPOSER_DFLASH,
    PROPOSER_DRAFT_MODEL,
    PROPOSER_EARLY_EXIT,
    PROPOSER_MTP,
    PROPOSER_NONE,
    PROPOSER_PROMPT_LOOKUP,
)
from specwire.wire.proposers import PROPOSER_FROM_PROTO


@dataclasses.dataclass
class DraftPolicy:
    """Server-side speculation settings of a target service.

    Args:
        draft_address (`str`, *optional*): the draft service (`host:port` or `dns:///name:port`).
        default_proposer (`str`): proposer for requests that choose none (`none`, `prompt_lookup`,
            `draft_model`); a request setting `prompt_lookup_num_tokens` always gets prompt lookup.
        round_timeout_s (`float`): deadline of each draft answer before falling back.
        prompt_lookup_tokens (`int`): draft length for prompt lookup when the request gives none.
        prompt_lookup_rule (`str`): matching rule of prompt lookup, see `PromptLookupDrafter`. Prompt lookup
            always runs in this process, with or without a draft service: it needs no model, and a round
            trip per round costs more than the lookup.
        draft_model (`LoadedModel`, *optional*): a co-located draft (`--draft-model`): `draft_model`
            requests draft with it in this process, no RPC, like transformers' assisted generation.
            Exclusive with `draft_address` (one draft model per target; refused at start).
        draft_overlap (`bool`, defaults to `True`): remote draft-model streams draft each next block
            ahead while the target verifies (`--draft-overlap`, decided by `draft_overlap_choice`).
        adaptive (`bool`, defaults to True): the adaptive speculation controller chooses the draft length
            of requests that name none (`--no-adaptive-speculation` turns it off: transformers' constant
            20, and `prompt_lookup_tokens` for prompt lookup).
        dflash_model (*optional*): a DFlash assistant (`--dflash-model`, `models.dflash_assistant`), on the
            target's device: `speculation_type="dflash"` requests draft with it (proposer `dflash`).
    """

    draft_address: str | None = None
    default_proposer: str = PROPOSER_NONE
    round_timeout_s: float = 5.0
    prompt_lookup_tokens: int = 10
    prompt_lookup_rule: str = "longest"
    draft_model: Any = None
    draft_overlap: bool = True
    adaptive: bool = True
    dflash_model: Any = None

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.draft_address is not None:
            raise ValueError(
                "--draft-model and --draft-address both name a draft model; give one: --draft-model runs it "
                "in the target's process, --draft-address on the draft service"
            )
        self._channel: DraftChannel | None = None
        self._channel_lock = threading.Lock()
        self._local_lock = threading.Lock()
        self._local_open = 0  # co-located drafters opened and not yet closed
        self._digests: dict[int, tuple[Any, tuple[int, bytes]]] = {}  # id(tokenizer) -> (tokenizer, digest)
        # The costs every request's controller measures and reads (the verify forward, each proposer's draft).
        self.costs = SharedCosts()

    @property
    def open_streams(self) -> int:
        """Draft streams (or co-located drafters, which hold KV caches) opened and not yet ended."""
        remote = self._channel.open_streams if self._channel is not None else 0
        return remote + self._local_open

    def _count_local(self, change: int) -> None:
        with self._local_lock:
            self._local_open += change

    def channel(self) -> DraftChannel:
        """The draft service's channel (one per target process, started on first use)."""
        with self._channel_lock:
            if self._channel is None:
                self._channel = DraftChannel(cast(str, self.draft_address))  # asked for only when one is set
            return self._channel

    def proposer(self, requested: int, config: Any) -> str:
        """The proposer a request runs with: its own choice, else the config's (`assistant_early_exit` first,
        then `prompt_lookup_num_tokens`, then `use_mtp`, transformers' order), else the server default."""
        early_exit = config.assistant_early_exit
        dflash = dflash_proposer(PROPOSER_FROM_PROTO.get(requested), config, self.dflash_model is not None)
        if dflash is not None:
            return dflash
        if requested in PROPOSER_FROM_PROTO:
            chosen = PROPOSER_FROM_PROTO[requested]
            if chosen == PROPOSER_MTP and not config.use_mtp:
                raise InvalidArgument.for_field(
                    "config.use_mtp",
                    config.use_mtp,
                    "proposer mtp drafts with the served model's multi-token prediction layers: set use_mtp=True",
                )
            if config.use_mtp and chosen not in (PROPOSER_MTP, PROPOSER_NONE):
                raise InvalidArgument.for_field(
                    "config.use_mtp",
                    True,
                    f"it selects the model's MTP draft and the request asks for proposer {chosen}: unset one of them",
                )
            if chosen == PROPOSER_EARLY_EXIT and early_exit is None:
                raise InvalidArgument.for_field(
                    "config.assistant_early_exit",
                    None,
                    "proposer early_exit drafts with the target's first N decoder layers: set assistant_early_exit=N",
                )
            if early_exit is not None and chosen not in (PROPOSER_EARLY_EXIT, PROPOSER_NONE):
                raise InvalidArgument.for_field(
                    "config.assistant_early_exit",
                    early_exit,
                    f"it selects the early-exit draft and the request asks for proposer {chosen}: unset one of them",
                )
            return chosen
        if early_exit is not None:
            return PROPOSER_EARLY_EXIT
        if config.prompt_lookup_num_tokens is not None:
            return PROPOSER_PROMPT_LOOKUP
        if config.use_mtp:
            return PROPOSER_MTP
        return self.default_proposer

    def _digest(self, tokenizer: Any) -> tuple[int, bytes] | None:
        """The tokenizer's size and digest, computed once per tokenizer (hashing a vocabulary takes ms)."""
        if tokenizer is None:
            return None
        with self._local_lock:
            known = self._digests.get(id(tokenizer))
            if known is None or known[0] is not tokenizer:
                known = (tokenizer, (len(tokenizer.get_vocab()), tokenizer_digest(tokenizer)))
                self._digests[id(tokenizer)] = known
            return known[1]

    def opener(
        self,
        proposer: str,
        vocab_size: int,
        *,
        target: Any = None,
        early_exit: int | None = None,
        stats: SpeculationStats | None = None,
        tokenizer: Any = None,
        speculates: bool = True,
        run_forward: ForwardRunner | None = None,
    ):
        """`open_drafter(rows, resolved_config) -> Drafter` for the decoding loop.

        Args:
            proposer (`str`): the request's proposer.
            vocab_size (`int`): the target's vocabulary size (width of its logits).
            target (*optional*), early_exit (`int`, *optional*): the served model and the request's
                `assistant_early_exit`, which make the early-exit draft, checked here, before any forward
                (INVALID_ARGUMENT for a layer count the served model does not have).
            stats (`SpeculationStats`, *optional*): the request's stats (hits and misses of the blocks a
                remote draft drafted ahead).
            tokenizer (*optional*): the target's tokenizer, whose digest remote draft-model streams send.
            speculates (`bool`, defaults to `True`): whether the request speculates at all (beam search, for one,
                decodes plainly): only then are the served model's MTP layers needed (transformers ignores
                `use_mtp` with beam search, with a warning, whatever the model).
            run_forward (`ForwardRunner`, *optional*): where the forwards of a drafter in this process run (the
                batched scheduler's `forward`); the thread that calls `propose` without it (the model thread).
        """
        draft_view = mtp = None
        if proposer == PROPOSER_EARLY_EXIT:
            draft_view = early_exit_model(target, cast(int, early_exit), field="config.assistant_early_exit")
        elif proposer == PROPOSER_MTP and speculates:
            mtp = mtp_model_for(target)  # INVALID_ARGUMENT for a model without MTP layers

        def open_drafter(rows: list[list[int]], config: Any) -> Drafter:
            if draft_view is not None:
                return self._local(draft_view, rows, config, vocab_size, run_forward)
            if proposer == PROPOSER_DFLASH:
                drafter = open_dflash_drafter(
                    self.dflash_model, target, rows, config, vocab_size, self._wants_probs(config)
                )
                return self._counted(drafter)
            if proposer == PROPOSER_MTP:
                if mtp is None:  # not loaded: the request was not to speculate
                    raise DraftFailure("the MTP layers were not loaded for a request that does not speculate")
                return self._counted(open_mtp_drafter(mtp, rows, config, vocab_size, self._wants_probs(config)))
            if proposer == PROPOSER_PROMPT_LOOKUP:
                return PromptLookupDrafter(rows, config, vocab_size, self.prompt_lookup_rule)
            if self.colocated(proposer):
                return self._colocated(rows, config, vocab_size, run_forward)
            if self.draft_address is None:
                raise DraftFailure("no draft model configured (start the target with --draft-model or --draft-address)")
            return RemoteDrafter(
                self.channel(),
                rows,
                config,
                vocab_size,
                self._wants_probs(config),
                self.round_timeout_s,
                caller_deadline(),
                overlap=self.draft_overlap,
                stats=stats,
                digest=self._digest(tokenizer),
            )

        return open_drafter

    def _colocated(
        self, rows: list[list[int]], config: Any, vocab_size: int, run_forward: ForwardRunner | None
    ) -> Drafter:
        """A drafter over the co-located draft model (see `_local`)."""
        return self._local(self.draft_model.model, rows, config, vocab_size, run_forward)

    def _local(
        self, model: Any, rows: list[list[int]], config: Any, vocab_size: int, run_forward: ForwardRunner | None
    ) -> Drafter:
        """A drafter over a model in this process: the co-located draft model, or the target's early-exit view
        (which shares the target's weights). Its forwards run through `run_forward` (the batched scheduler's
        thread), else where `propose` is called (the model thread); never on the event loop."""
        drafter = open_model_drafter(
            model,
            rows,
            config,
            vocab_size,
            self._wants_probs(config),
            forward=lean_draft_forward,
            run_forward=run_forward,
        )
        return self._counted(drafter)

    @staticmethod
    def _wants_probs(config: Any) -> bool:
        """Probabilities when the target samples from them or a greedy ensemble mixes them in, as remotely."""
        return bool(config.do_sample) or config.assistant_ensemble_weight is not None

    def _counted(self, drafter: Any) -> Drafter:
        """A drafter of this process, counted in `open_streams` until closed."""
        self._count_local(1)
        return _CountedDrafter(drafter, self._count_local)

    def ensemble_warning(self, proposer: str, config: Any, num_beams: int) -> FieldProblem | None:
        """`assistant_ensemble_weight` in the context it runs in: mixed into the acceptance of a draft
        model's drafts; refused with prompt lookup, as transformers refuses it (its drafts carry no
        distribution to mix); a warning when the request runs without drafts (no proposer, or beam
        search, which falls back to plain decoding)."""
        weight = config.assistant_ensemble_weight
        if weight is None:
            return None
        if proposer == PROPOSER_PROMPT_LOOKUP:
            raise InvalidArgument.for_field(
                "config.assistant_ensemble_weight",
                weight,
                "the ensemble mixes the draft model's probabilities into the acceptance and prompt lookup drafts "
                "have none (transformers refuses it too); unset it or use proposer='draft_model'",
            )
        if proposer == PROPOSER_NONE or num_beams > 1:
            return FieldProblem(
                "config.assistant_ensemble_weight",
                weight,
                "not honoured: it applies to speculative decoding with a draft model, and this request runs "
                + ("beam search (no speculation)" if num_beams > 1 else "without a drafter (proposer none)"),
                "warning",
            )
        return None

    def draft_length(self, proposer: str, config: Any, target: Any = None) -> int | None:
        """Constant draft length for prompt lookup (transformers applies no schedule to it), and for MTP: the
        model's `num_mtp_layers` (its layers draft that many tokens every round, whatever the schedule)."""
        if proposer == PROPOSER_PROMPT_LOOKUP:
            return config.prompt_lookup_num_tokens or self.prompt_lookup_tokens
        if proposer == PROPOSER_MTP and target is not None:
            return mtp_layer_count(target)
        if proposer == PROPOSER_DFLASH:
            return int(self.dflash_model.config.block_size) - 1  # one denoised block a round
        return None

    def hidden_layers(self, proposer: str) -> list[int] | None:
        """The target's hidden-state indices the proposer's drafter reads every round (DFlash), or None."""
        if proposer == PROPOSER_DFLASH:
            return dflash_hidden_layers(self.dflash_model)
        return None

    def controller(
        self,
        proposer: str,
        named_fields: tuple[str, ...],
        load: Callable[[], float] | None,
        greedy: bool = True,
        draft_load: Callable[[], float] | None = None,
    ) -> SpeculationController | None:
        """The adaptive controller of a request, or None when its draft lengths are decided otherwise.

        Args:
            proposer (`str`): the request's proposer.
            named_fields (`tuple[str, ...]`): the draft-length fields the request (its overrides, its
                config or its registry config) sets; any of them keeps transformers' schedule exact.
            load (`Callable[[], float]`, *optional*): other requests waiting on this one's forwards now.
            greedy (`bool`, *optional*, defaults to `True`): the request decodes greedily, so a draft model's
                guesses of the target's tokens are the drafts it would have had kept (`look_back`).
            draft_load (`Callable[[], float]`, *optional*): other requests drafting with the same proposer now;
                read for a remote draft service only (a co-located draft counts every request, `load`).
        """
        # MTP drafts all its layers' tokens every round (transformers' MTPCandidateGenerator), DFlash a whole
        # denoised block: no length to adapt.
        if not self.adaptive or proposer in (PROPOSER_NONE, PROPOSER_MTP, PROPOSER_DFLASH) or named_fields:
            return None
        look_back = proposer == PROPOSER_DRAFT_MODEL and greedy
        return SpeculationController(
            self.costs,
            proposer,
            load=load,
            shares_device=self.colocated(proposer),
            draft_load=draft_load if self.remote(proposer) else None,
            overlapped=self.remote(proposer) and self.draft_overlap,
            look_back=look_back,
        )

    def remote(self, proposer: str) -> bool:
        """Whether `proposer`'s drafts come from the draft service (`--draft-address`, no `--draft-model`)."""
        return proposer == PROPOSER_DRAFT_MODEL and self.draft_model is None and self.draft_address is not None

    def prefills_apart(self, proposer: str) -> bool:
        """Whether `proposer`'s draft session opens on the prompt before the target's prefill, so that the draft
        service prefills it meanwhile (`speculative_loop(prefill_apart=...)`): a remote draft that overlaps
        (`draft_overlap`), which says it computes beside the target, not on its cores. Where it shares them (a CPU
        target with its draft service on loopback, `draft_overlap_choice`), every request's early prefill took them
        from the target's forwards even where the request never drafted: 8 clients on such a target, none of whose
        requests drafted, ran 0.85x of plain greedy over 4 pairs of waves (0.75x-0.94x), and 1.04x without it."""
        return self.remote(proposer) and self.draft_overlap

    def colocated(self, proposer: str) -> bool:
        """Whether `proposer`'s drafts are computed in this process, on the target's device (`--draft-model`;
        early exit does too, but is not adaptive)."""
        return proposer == PROPOSER_DRAFT_MODEL and self.draft_model is not None

    def close(self) -> None:
        """Cancel the draft streams still open and close the channel."""
        with self._channel_lock:
            channel = self._channel
        if channel is not None:
            channel.close()


class _CountedDrafter:
    """A co-located drafter counted in `DraftPolicy.open_streams` until closed (the leak tests read it)."""

    def __init__(self, drafter: Drafter, count):
        self.drafter = drafter
        self._count = count
        self._closed = False
        self._lock = threading.Lock()

    def propose(self, num_tokens: int) -> Proposal:
        if self._closed:
            raise DraftFailure("the drafter is closed")
        return self.drafter.propose(num_tokens)

    def bind_hidden_states(self, source: Any) -> None:
        """Hand the rows' hidden states on to a drafter that drafts from them (MTP)."""
        bind_hidden_states(self.drafter, source)

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        if not self._closed:  # closed by the request's end (cancel, deadline) while its thread verified
            self.drafter.feedback(num_accepted, appended, finished)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drafter.close()  # drops the KV caches (a propose still running keeps its own references)
        self._count(-1)


def draft_overlap_choice(mode: str, draft_address: str | None, device: str | torch.device) -> tuple[bool, str]:
    """Whether remote draft-model streams draft ahead (`--draft-overlap auto|on|off`), and why.

    `auto` overlaps unless the target runs on CPU and the draft service is on this machine (a loopback address or a
    local socket, `stays_on_this_machine`): both would then compute at once on the same cores, and two thread pools
    on the same cores wait for each other's threads at every operation. On 2 CPU cores, unpinned, transformers'
    constant 20-token blocks decoded the demo's answer at 2-3 tokens/s overlapped against 7.4-7.8 serial (plain
    decoding: 10-12); with the target and the draft service pinned to a core each (`taskset`), overlapped 8.0-8.4
    against serial 7.4-7.8. So `auto` cannot see pinning: `on` says the draft has cores of its own."""
    if mode in ("on", "off"):
        return mode == "on", f"--draft-overlap {mode}"
    if mode != "auto":
        raise ValueError(f"--draft-overlap must be auto, on or off, got {mode!r}")
    if draft_address is None:
        return True, "auto: no draft service"
    if stays_on_this_machine(draft_address) and torch.device(device).type == "cpu":
        return False, (
            f"auto: the draft service {draft_address} is on this machine and the target computes on its CPU, so "
            "drafting ahead would take the cores verification runs on; --draft-overlap on when the two are pinned "
            "to separate cores"
        )
    return True, "auto: the draft service computes apart from this target"


def check_draft_model(target: Any, draft: Any) -> None:
    """Refuse a co-located draft whose tokenizer differs from the target's (ValueError with the reason).

    Draft token ids are verified as the target's ids, so both must map text to the same ids (transformers'
    assisted generation assumes it as well; universal assisted decoding is not implemented).
    """
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"the draft model {draft.model_id} has another vocabulary than the target {target.model_id} "
            f"({len(draft_vocab)} tokens against {len(target_vocab)}; differing entries e.g. {differing}): "
            "its token ids would mean other tokens; use a draft model with the target's tokenizer"
        )
