"""The target's side of speculation: which drafter a request uses, and the remote drafter.

`RemoteDrafter` speaks the DraftService stream in lockstep with the decoding loop: the first
`propose()` sends `DraftStart`, each later one sends the pending feedback with the next block size,
so a round costs one round trip. Every answer must arrive within the round deadline; a late,
broken or refused stream raises `DraftFailure`, and the loop finishes the request with plain
decoding (same output). The next request opens a new stream, so drafting resumes as soon as the
draft service is back.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

import grpc

from specwire.common.v1 import common_pb2
from specwire.deadline import caller_deadline, remaining
from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.generation.drafters import Drafter, PromptLookupDrafter, Proposal
from specwire.generation.speculative_loop import DraftFailure
from specwire.security import secure_channel
from specwire.target.v1 import target_service_pb2 as target_pb
from specwire.wire.generation_config import config_to_proto
from specwire.wire.tensors import tensor_from_proto

log = logging.getLogger("specwire.target_service.drafting")

PROPOSER_NAMES = {
    target_pb.PROPOSER_NONE: "none",
    target_pb.PROPOSER_PROMPT_LOOKUP: "prompt_lookup",
    target_pb.PROPOSER_DRAFT_MODEL: "draft_model",
}
_END = object()


class RemoteDrafter:
    """A `Drafter` behind a DraftService stream.

    Args:
        stub (`DraftServiceStub`): a stub on the draft service's channel.
        rows (`list[list[int]]`): each row's tokens so far.
        config (`GenerationConfig`): the request's resolved config (processors, sampling, prompt lookup).
        method (`int`): `DRAFT_METHOD_PROMPT_LOOKUP` or `DRAFT_METHOD_MODEL`.
        vocab_size (`int`): the target's vocabulary size.
        return_probs (`bool`): ask for the draft's probabilities (the target samples).
        round_timeout_s (`float`): deadline of each answer.
        deadline (`float`, *optional*): the caller's deadline (`specwire.deadline`, `time.monotonic()`
            clock): the stream's deadline, and every round waits at most until then.
    """

    def __init__(self, stub, rows, config, method, vocab_size, return_probs, round_timeout_s, deadline=None):
        self.timeout = round_timeout_s
        self.deadline = deadline
        self.requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.start = pb.DraftStart(
            rows=[common_pb2.TokenSequence(ids=r) for r in rows],
            method=method,
            config=config_to_proto(config),
            vocab_size=vocab_size,
            return_probs=return_probs,
        )
        self.pending: pb.DraftFeedback | None = None
        self.call = stub.Draft(iter(self.requests.get, _END), timeout=remaining(deadline=deadline))
        self.reader = threading.Thread(target=self._read, daemon=True, name="specwire-draft-reader")
        self.reader.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
            self.responses.put(DraftFailure("the draft stream ended"))
        except grpc.RpcError as exc:
            self.responses.put(DraftFailure(f"{exc.code().name}: {exc.details()}"))

    def propose(self, num_tokens: int) -> Proposal:
        if self.start is not None:
            self.start.num_tokens = num_tokens
            self.requests.put(pb.DraftRequest(start=self.start))
            self.start = None
        else:
            feedback = self.pending or pb.DraftFeedback()
            feedback.num_tokens = num_tokens
            self.requests.put(pb.DraftRequest(feedback=feedback))
            self.pending = None
        timeout = remaining(self.timeout, deadline=self.deadline)  # min(--draft-timeout, the caller's time)
        try:
            answer = self.responses.get(timeout=timeout)
        except queue.Empty:
            raise DraftFailure(f"no draft within the {timeout:.2f}s round deadline") from None
        if isinstance(answer, DraftFailure):
            raise answer
        probs = [tensor_from_proto(r.probs) if r.HasField("probs") else None for r in answer.rows]
        return Proposal([list(r.token_ids) for r in answer.rows], probs)

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        self.pending = pb.DraftFeedback(
            rows=[
                pb.RowFeedback(num_accepted=n, appended_ids=a, finished=f)
                for n, a, f in zip(num_accepted, appended, finished, strict=True)
            ]
        )

    def close(self) -> None:
        self.requests.put(_END)
        self.call.cancel()


@dataclasses.dataclass
class DraftPolicy:
    """Server-side speculation settings of a target service.

    Args:
        draft_address (`str`, *optional*): the draft service (`host:port` or `dns:///name:port`).
        default_proposer (`str`): proposer for requests that choose none (`none`, `prompt_lookup`,
            `draft_model`); a request setting `prompt_lookup_num_tokens` always gets prompt lookup.
        round_timeout_s (`float`): deadline of each draft answer before falling back.
        prompt_lookup_tokens (`int`): draft length for prompt lookup when the request gives none.
        prompt_lookup_rule (`str`): matching rule of in-process prompt lookup (no draft service), see
            `PromptLookupDrafter`; the draft service has its own `--prompt-lookup-rule`.
    """

    draft_address: str | None = None
    default_proposer: str = "none"
    round_timeout_s: float = 5.0
    prompt_lookup_tokens: int = 10
    prompt_lookup_rule: str = "longest"

    def __post_init__(self) -> None:
        self._channel = None
        self._stub = None

    def stub(self):
        if self._stub is None:
            self._channel = secure_channel(self.draft_address)
            self._stub = pb_grpc.DraftServiceStub(self._channel)
        return self._stub

    def proposer(self, requested: int, config: Any) -> str:
        """The proposer a request runs with: its own choice, else the config's, else the server default."""
        if requested in PROPOSER_NAMES:
            return PROPOSER_NAMES[requested]
        if config.prompt_lookup_num_tokens is not None:
            return "prompt_lookup"
        return self.default_proposer

    def opener(self, proposer: str, vocab_size: int):
        """`open_drafter(rows, resolved_config) -> Drafter` for the decoding loop."""

        def open_drafter(rows: list[list[int]], config: Any) -> Drafter:
            sampling = bool(config.do_sample)
            if proposer == "prompt_lookup":
                if self.draft_address is None:
                    return PromptLookupDrafter(rows, config, vocab_size, self.prompt_lookup_rule)
                method = pb.DRAFT_METHOD_PROMPT_LOOKUP
            else:
                if self.draft_address is None:
                    raise DraftFailure("no draft service configured (start the target with --draft-address)")
                method = pb.DRAFT_METHOD_MODEL
            return RemoteDrafter(
                self.stub(),
                rows,
                config,
                method,
                vocab_size,
                sampling and method == pb.DRAFT_METHOD_MODEL,
                self.round_timeout_s,
                caller_deadline(),
            )

        return open_drafter

    def draft_length(self, proposer: str, config: Any) -> int | None:
        """Constant draft length for prompt lookup (transformers applies no schedule to it)."""
        if proposer == "prompt_lookup":
            return config.prompt_lookup_num_tokens or self.prompt_lookup_tokens
        return None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
