"""`specwire.draft.v1.DraftService`: one bidirectional stream per generation request.

The target sends `DraftStart` (rows, method, effective config), then one `DraftFeedback` per
verification round; every message is answered with the next block of proposals. The session
(`specwire.generation.speculation.drafters`) lives as long as the stream, so a request's KV caches stay on one
replica and are rolled back rather than re-encoded.

Sessions are counted and bounded. At most `max_sessions` are open at once (a `DraftStart` beyond
that gets RESOURCE_EXHAUSTED with a retry hint; the target then decodes that request without
drafts). A stream that sends nothing for `session_idle_timeout_s` is ended with DEADLINE_EXCEEDED.
However the stream ends (the target half-closes it, cancels it, dies, or goes idle), its session is
closed and its KV caches freed, on the model thread after any work of it still running there.

Overlap (`DraftStart.overlap`, draft models only): after answering a block, the session drafts the
next one ahead on the model thread while the target verifies (`specwire.generation.speculation.
draft_ahead`, where the losslessness argument is). That work is speculative and gives way: it stops at
the next forward when the session's feedback arrives, when the stream ends (cancelled, deadline,
target gone), or when another session's real work waits for the model thread, so it never delays a
real answer by more than one draft forward.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted
from specwire.generation.speculation.draft_ahead import AHEAD_HIT, AHEAD_MISS, AHEAD_NONE, OverlappingModelDrafter
from specwire.generation.speculation.drafters import Drafter, PromptLookupDrafter, Proposal, open_model_drafter
from specwire.model_thread import STOP_TIMEOUT_S, ModelExecutor
from specwire.models import LoadedModel
from specwire.models.tokenizer_digest import tokenizer_digest
from specwire.runtime.lean_draft import draft_decoder, lean_draft_forward
from specwire.serving import handles_errors
from specwire.wire.generation_config import WireFormatError, config_from_proto
from specwire.wire.tensors import tensor_to_proto

log = logging.getLogger("specwire.draft_service")

MAX_DRAFT_TOKENS = 64
MAX_ROWS = 256
DEFAULT_MAX_SESSIONS = 64
DEFAULT_SESSION_IDLE_TIMEOUT_S = 60.0


def _check_tokenizer(start: pb.DraftStart, draft_model: LoadedModel, digest: bytes) -> None:
    """Refuse a target whose tokenizer is not the draft model's (draft ids would mean other tokens).

    The widths of the two models' heads may differ legitimately (embeddings padded beyond the
    tokenizer, e.g. Qwen2.5 0.5B and 7B): the drafter cuts or pads logits to the target's width. The
    vocabularies themselves must be equal, as `check_draft_model` requires of a co-located draft.
    """
    if not start.tokenizer_digest or draft_model.tokenizer is None:
        return  # a target without a tokenizer (or an older one) sends no digest: nothing to compare
    if digest != start.tokenizer_digest:
        size = len(draft_model.tokenizer.get_vocab())
        raise FailedPrecondition(
            f"the draft model {draft_model.model_id} has another vocabulary than the target "
            f"({size} tokens against the target's {start.tokenizer_size}): its token ids would mean other "
            "tokens; serve a draft model with the target's tokenizer, or use DRAFT_METHOD_PROMPT_LOOKUP"
        )


def _open_session(
    start: pb.DraftStart, draft_model: LoadedModel | None, prompt_lookup_rule: str, digest: bytes = b""
) -> Drafter:
    if not start.rows:
        raise InvalidArgument.for_field("start.rows", [], "send at least one row of tokens")
    if len(start.rows) > MAX_ROWS:
        raise InvalidArgument.for_field("start.rows", len(start.rows), f"at most {MAX_ROWS} rows per stream")
    if start.vocab_size <= 0:
        raise InvalidArgument.for_field("start.vocab_size", start.vocab_size, "send the target model's vocabulary size")
    rows = [list(r.ids) for r in start.rows]
    for i, row in enumerate(rows):
        if not row:
            raise InvalidArgument.for_field(f"start.rows[{i}]", [], "every row needs at least one token")
        if min(row) < 0 or max(row) >= start.vocab_size:
            raise InvalidArgument.for_field(f"start.rows[{i}]", row, f"token ids must be in [0, {start.vocab_size})")
    try:
        config = config_from_proto(start.config)
    except (WireFormatError, TypeError, ValueError) as exc:
        raise InvalidArgument.for_field("start.config", None, f"not a valid GenerationConfig: {exc}") from exc
    if start.method == pb.DRAFT_METHOD_PROMPT_LOOKUP:
        if start.overlap:
            raise InvalidArgument.for_field(
                "start.overlap",
                True,
                "overlap drafts a draft model's next block ahead; prompt lookup drafts in microseconds, "
                "with nothing to hide: unset it",
            )
        return PromptLookupDrafter(rows, config, start.vocab_size, prompt_lookup_rule)
    if start.method == pb.DRAFT_METHOD_MODEL:
        if draft_model is None:
            raise FailedPrecondition(
                "this draft service has no draft model (start it with --model); use DRAFT_METHOD_PROMPT_LOOKUP"
            )
        _check_tokenizer(start, draft_model, digest)
        return open_model_drafter(
            draft_model.model,
            rows,
            config,
            start.vocab_size,
            start.return_probs,
            overlap=start.overlap,
            forward=lean_draft_forward,
        )
    raise InvalidArgument.for_field(
        "start.method", start.method, "choose DRAFT_METHOD_PROMPT_LOOKUP or DRAFT_METHOD_MODEL"
    )


def _check_num_tokens(value: int, field: str) -> int:
    if not 0 <= value <= MAX_DRAFT_TOKENS:
        raise InvalidArgument.for_field(field, value, f"ask for 0-{MAX_DRAFT_TOKENS} draft tokens per round")
    return value


_AHEAD_TO_PROTO = {
    AHEAD_NONE: pb.DRAFT_AHEAD_UNSPECIFIED,
    AHEAD_HIT: pb.DRAFT_AHEAD_HIT,
    AHEAD_MISS: pb.DRAFT_AHEAD_MISS,
}


def _response(proposal: Proposal, outcomes: list[int] | None = None) -> pb.DraftResponse:
    """The wire form of a block; `outcomes` (overlap) says per row what became of its block drafted ahead
    (`draft_ahead.AHEAD_*`, numbered as `DraftAhead`)."""
    rows = []
    for i, (tokens, probs) in enumerate(zip(proposal.tokens, proposal.probs, strict=True)):
        row = pb.RowDraft(token_ids=tokens, ahead=_AHEAD_TO_PROTO[outcomes[i] if outcomes else AHEAD_NONE])
        if proposal.hindsight is not None:
            row.hindsight_checked, row.hindsight_kept, row.hindsight_confident = proposal.hindsight[i]
        if probs is not None:
            row.probs.CopyFrom(tensor_to_proto(probs.float()))
        rows.append(row)
    return pb.DraftResponse(rows=rows)


def _apply_feedback(session: Drafter, feedback: pb.DraftFeedback, last: Proposal) -> Proposal:
    if len(feedback.rows) != len(last.tokens):
        raise InvalidArgument.for_field(
            "feedback.rows", len(feedback.rows), f"send one entry per row ({len(last.tokens)})"
        )
    accepted = []
    for i, (row, drafted) in enumerate(zip(feedback.rows, last.tokens, strict=True)):
        if not 0 <= row.num_accepted <= len(drafted):
            raise InvalidArgument.for_field(
                f"feedback.rows[{i}].num_accepted",
                row.num_accepted,
                f"between 0 and the {len(drafted)} drafted",
            )
        accepted.append(row.num_accepted)
    session.feedback(accepted, [list(r.appended_ids) for r in feedback.rows], [r.finished for r in feedback.rows])
    return session.propose(feedback.num_tokens)


class DraftServicer(pb_grpc.DraftServiceServicer):
    """Drafting sessions over an optional draft model (prompt lookup is always available).

    Every session's work runs on one thread (`specwire.model_thread`): the forwards of one model
    would not run faster side by side, and a second thread running forwards slows them all.

    Args:
        draft_model (`LoadedModel`, *optional*): the draft LM.
        prompt_lookup_rule (`str`, defaults to `"longest"`): see `PromptLookupDrafter`.
        max_sessions (`int`, defaults to 64): sessions open at once; a `DraftStart` beyond them gets
            RESOURCE_EXHAUSTED with a retry hint.
        session_idle_timeout_s (`float`, defaults to 60.0): a stream that sends nothing for this long
            is ended with DEADLINE_EXCEEDED and its session freed (`None`: never).
    """

    def __init__(
        self,
        draft_model: LoadedModel | None = None,
        prompt_lookup_rule: str = "longest",
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_idle_timeout_s: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S,
    ):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        if session_idle_timeout_s is not None and session_idle_timeout_s <= 0:
            raise ValueError(f"session_idle_timeout_s must be positive (or None), got {session_idle_timeout_s}")
        self.draft_model = draft_model
        self.prompt_lookup_rule = prompt_lookup_rule
        self.max_sessions = max_sessions
        self.session_idle_timeout_s = session_idle_timeout_s
        self.executor = ModelExecutor("specwire-draft")
        if draft_model is not None:  # the lean forward's one-time check, before the first request times it
            self.executor.submit(draft_decoder, draft_model.model)
        # Sessions opened and not yet closed (their KV caches are held); written on the event loop
        # only, read by tests and observability.
        self.open_sessions = 0
        self._reserved = 0  # streams past their DraftStart's admission, session open or opening
        # Real jobs handed to the model thread, and started there: drafting ahead stops while they differ.
        self._real_submitted = 0  # written on the event loop only
        self._real_started = 0  # written on the model thread only
        self._real_dropped = 0  # cancelled before they started; written on the event loop only
        # The draft model's vocabulary, compared with the target's when a stream opens.
        tokenizer = draft_model.tokenizer if draft_model is not None else None
        self._digest = tokenizer_digest(tokenizer) if tokenizer is not None else b""

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the model thread once the server stopped: the work not started is dropped, the running one ends
        (within `timeout` seconds, else it is reported: `specwire.model_thread.join_or_report`)."""
        self.executor.close(timeout)

    def _admit(self) -> None:
        if self._reserved >= self.max_sessions:
            raise ResourceExhausted(
                f"the draft service has {self._reserved} sessions open (--max-sessions {self.max_sessions}); "
                "retry later, or decode without drafts",
                retry_after_s=1.0,
            )
        self._reserved += 1

    async def _next(self, messages) -> pb.DraftRequest | None:
        """The stream's next message (None at its end), or DEADLINE_EXCEEDED once it is idle too long."""
        try:
            return await asyncio.wait_for(anext(messages, None), self.session_idle_timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the draft session was idle for more than {self.session_idle_timeout_s:g}s "
                "(--session-idle-timeout) and was closed; open a new stream"
            ) from None

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run real work (a session's opening or its next answer) on the model thread; drafting ahead
        gives way to it (`_others_wait`)."""
        self._real_submitted += 1
        lock, state = threading.Lock(), {"started": False, "dropped": False}

        def job() -> Any:
            with lock:
                if state["dropped"]:
                    return None  # its caller was cancelled while it waited: nobody wants the answer
                state["started"] = True
            self._real_started += 1
            return fn(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, job)
        except asyncio.CancelledError:
            with lock:
                if not state["started"]:  # it will never start: no longer waiting
                    state["dropped"] = True
                    self._real_dropped += 1
            raise

    def _others_wait(self) -> bool:
        """Real work is queued for the model thread (each counter has one writer: no lock needed)."""
        return self._real_submitted - self._real_dropped > self._real_started

    @handles_errors
    async def Draft(self, request_iterator, context):
        session: Drafter | None = None
        last: Proposal | None = None
        admitted = False
        messages = aiter(request_iterator)
        ahead = _DraftingAhead(self)
        try:
            while (message := await self._next(messages)) is not None:
                await ahead.stop()  # the feedback arrived: what was drafted ahead is kept, the rest given up
                kind = message.WhichOneof("message")
                if kind == "start":
                    if admitted:
                        raise FailedPrecondition("a stream carries one DraftStart; open a new stream per request")
                    num_tokens = _check_num_tokens(message.start.num_tokens, "start.num_tokens")
                    self._admit()
                    admitted = True
                    session = await self._run(
                        _open_session, message.start, self.draft_model, self.prompt_lookup_rule, self._digest
                    )
                    self.open_sessions += 1
                    last = await self._run(session.propose, num_tokens)
                elif kind == "feedback":
                    if session is None or last is None:
                        raise FailedPrecondition("send DraftStart before DraftFeedback")
                    _check_num_tokens(message.feedback.num_tokens, "feedback.num_tokens")
                    last = await self._run(_apply_feedback, session, message.feedback, last)
                else:
                    raise InvalidArgument.for_field("message", None, "set start or feedback")
                overlapping = isinstance(session, OverlappingModelDrafter)
                yield _response(last, session.outcomes if overlapping else None)
                if overlapping:  # the answer is on its way: draft the next block while the target verifies
                    ahead.begin(cast(OverlappingModelDrafter, session))
        finally:
            ahead.cancel()  # the stream ended (done, cancelled, past its deadline, target gone)
            if admitted:
                self._reserved -= 1
            if session is not None:
                self.open_sessions -= 1
                # Off the event loop (a draft model's caches), and after any propose (or drafting ahead)
                # still running for this session on the model thread (the stream was cancelled meanwhile).
                self.executor.submit(_close_quietly, session)


class _DraftingAhead:
    """One stream's drafting ahead on the model thread: started after each answer, stopped (between two
    forwards) when the next message arrives or the stream ends, or while other work waits."""

    def __init__(self, servicer: DraftServicer):
        self.servicer = servicer
        self.stopped = threading.Event()
        self.future: asyncio.Future | None = None

    def begin(self, session: OverlappingModelDrafter) -> None:
        self.stopped = stopped = threading.Event()
        others_wait = self.servicer._others_wait
        self.future = asyncio.get_running_loop().run_in_executor(
            self.servicer.executor, session.draft_ahead, lambda: stopped.is_set() or others_wait()
        )

    async def stop(self) -> None:
        """Stop drafting ahead and wait for it to give the thread back (its failure is the stream's)."""
        future, self.future = self.future, None
        if future is not None:
            self.stopped.set()
            await future

    def cancel(self) -> None:
        """Stop drafting ahead without waiting (the stream is ending; the session closes after it)."""
        self.stopped.set()
        future, self.future = self.future, None
        if future is not None and not future.cancel():  # not started yet: never starts
            future.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("drafting ahead failed after its stream ended", exc_info=future.exception())


def _close_quietly(session: Drafter) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - cleanup of an ended stream must not kill the model thread
        log.exception("closing a draft session failed")
