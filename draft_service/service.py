"""`specwire.draft.v1.DraftService`: one bidirectional stream per generation request.

The target sends `DraftStart` (rows, method, effective config), then one `DraftFeedback` per
verification round; every message is answered with the next block of proposals. The session
(`specwire.generation.drafters`) lives as long as the stream, so a request's KV caches stay on one
replica and are rolled back rather than re-encoded.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.errors import FailedPrecondition, InvalidArgument
from specwire.generation.drafters import Drafter, ModelDrafter, PromptLookupDrafter, Proposal
from specwire.model_thread import model_executor
from specwire.models import LoadedModel
from specwire.serving import handles_errors
from specwire.wire.generation_config import WireFormatError, config_from_proto
from specwire.wire.tensors import tensor_to_proto

log = logging.getLogger("specwire.draft_service")

MAX_DRAFT_TOKENS = 64
MAX_ROWS = 256


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
        generator = None
        if config.do_sample:
            device = next(draft_model.model.parameters()).device
            generator = torch.Generator(device=device)
            generator.manual_seed(config.seed if config.seed is not None else torch.seed())
        return ModelDrafter(draft_model.model, rows, config, start.vocab_size, start.return_probs, generator)
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
    """

    def __init__(self, draft_model: LoadedModel | None = None, prompt_lookup_rule: str = "longest"):
        self.draft_model = draft_model
        self.prompt_lookup_rule = prompt_lookup_rule
        self.executor = model_executor("specwire-draft")
        self.open_sessions = 0

    @handles_errors
    async def Draft(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        session: Drafter | None = None
        last: Proposal | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("message")
                if kind == "start":
                    if session is not None:
                        raise FailedPrecondition("a stream carries one DraftStart; open a new stream per request")
                    num_tokens = _check_num_tokens(message.start.num_tokens, "start.num_tokens")
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
            if session is not None:
                self.open_sessions -= 1
                session.close()
