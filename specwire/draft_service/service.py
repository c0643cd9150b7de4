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
"""

from __future__ import annotations

import asyncio
import logging

from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted
from specwire.generation.speculation.drafters import Drafter, PromptLookupDrafter, Proposal, open_model_drafter
from specwire.model_thread import model_executor
from specwire.models import LoadedModel
from specwire.serving import handles_errors
from specwire.wire.generation_config import WireFormatError, config_from_proto
from specwire.wire.tensors import tensor_to_proto

log = logging.getLogger("specwire.draft_service")

MAX_DRAFT_TOKENS = 64
MAX_ROWS = 256
DEFAULT_MAX_SESSIONS = 64
DEFAULT_SESSION_IDLE_TIMEOUT_S = 60.0


def _open_session(start: pb.DraftStart, draft_model: LoadedModel | None, prompt_lookup_rule: str) -> Drafter:
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
        return PromptLookupDrafter(rows, config, start.vocab_size, prompt_lookup_rule)
    if start.method == pb.DRAFT_METHOD_MODEL:
        if draft_model is None:
            raise FailedPrecondition(
                "this draft service has no draft model (start it with --model); use DRAFT_METHOD_PROMPT_LOOKUP"
            )
        return open_model_drafter(draft_model.model, rows, config, start.vocab_size, start.return_probs)
    raise InvalidArgument.for_field(
        "start.method", start.method, "choose DRAFT_METHOD_PROMPT_LOOKUP or DRAFT_METHOD_MODEL"
    )


def _check_num_tokens(value: int, field: str) -> int:
    if not 0 <= value <= MAX_DRAFT_TOKENS:
        raise InvalidArgument.for_field(field, value, f"ask for 0-{MAX_DRAFT_TOKENS} draft tokens per round")
    return value


def _response(proposal: Proposal) -> pb.DraftResponse:
    rows = []
    for tokens, probs in zip(proposal.tokens, proposal.probs, strict=True):
        row = pb.RowDraft(token_ids=tokens)
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
        self.executor = model_executor("specwire-draft")
        # Sessions opened and not yet closed (their KV caches are held); written on the event loop
        # only, read by tests and observability.
        self.open_sessions = 0
        self._reserved = 0  # streams past their DraftStart's admission, session open or opening

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

    @handles_errors
    async def Draft(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        session: Drafter | None = None
        last: Proposal | None = None
        admitted = False
        messages = aiter(request_iterator)
        try:
            while (message := await self._next(messages)) is not None:
                kind = message.WhichOneof("message")
                if kind == "start":
                    if admitted:
                        raise FailedPrecondition("a stream carries one DraftStart; open a new stream per request")
                    num_tokens = _check_num_tokens(message.start.num_tokens, "start.num_tokens")
                    self._admit()
                    admitted = True
                    session = await loop.run_in_executor(
                        self.executor, _open_session, message.start, self.draft_model, self.prompt_lookup_rule
                    )
                    self.open_sessions += 1
                    last = await loop.run_in_executor(self.executor, session.propose, num_tokens)
                elif kind == "feedback":
                    if session is None or last is None:
                        raise FailedPrecondition("send DraftStart before DraftFeedback")
                    _check_num_tokens(message.feedback.num_tokens, "feedback.num_tokens")
                    last = await loop.run_in_executor(self.executor, _apply_feedback, session, message.feedback, last)
                else:
                    raise InvalidArgument.for_field("message", None, "set start or feedback")
                yield _response(last)
        finally:
            if admitted:
                self._reserved -= 1
            if session is not None:
                self.open_sessions -= 1
                # Off the event loop (a draft model's caches), and after any propose still running for
                # this session on the model thread (the stream was cancelled while it ran).
                self.executor.submit(_close_quietly, session)


def _close_quietly(session: Drafter) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - cleanup of an ended stream must not kill the model thread
        log.exception("closing a draft session failed")
