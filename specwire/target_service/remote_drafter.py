"""The remote drafter: a draft service's stream, in lockstep with the target's decoding loop.

`RemoteDrafter` speaks the DraftService stream in lockstep with the decoding loop: the first
`propose()` sends `DraftStart`, each later one sends the pending feedback with the next block size,
so a round costs one round trip. Every answer must arrive within the round deadline; a late,
broken, refused or malformed answer raises `DraftFailure`, and the loop finishes the request with
plain decoding (same output). The next request opens a new stream, so drafting resumes as soon as
the draft service is back.

Threads. Every draft stream of the process is a `grpc.aio` call on one event loop of its own
(`DraftChannel`, thread `specwire-draft-io`): a stream, idle or not, holds no thread, and nothing
but the call itself is left to release when it ends. (A sync stream-stream call costs gRPC a thread
blocked on the request iterator, and reading its answers with a deadline costs a reader thread: two
threads per stream, which leaked whenever a stream was not closed.) `close()` ends the call on every
exit path of the decoding loop (`speculative_loop` closes its drafter in a `finally`).

Prefill apart (`prefill()`): a session opened on the prompt alone, before the target's own prefill, sends its
`DraftStart` at once and reads the answer at the first `propose`, so the draft service prefills the prompt on its
own device while the target prefills (the target service opens an overlapped draft's sessions so,
`DraftPolicy.prefills_apart`: where the draft service shares the target's cores, early prefills slow the target).

Overlap (`DraftPolicy.draft_overlap`, `--draft-overlap`, `drafting.draft_overlap_choice`): draft-model
streams ask the draft service to draft the next block ahead while this target verifies
(`DraftStart.overlap`); the proposals are the ones serial drafting makes, so nothing here changes but
the wait. Each answer says per row
whether it came from the block drafted ahead, counted in the request's `speculation` stats
(`draft_ahead_hits`/`draft_ahead_misses`). Every draft-model stream also sends the target tokenizer's
digest, so a draft service whose model has another vocabulary refuses the stream (and the request
decodes without drafts, saying why in `fallback_reason`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import grpc

from specwire.common.v1 import common_pb2
from specwire.deadline import remaining
from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.generation.speculation.drafters import DraftFailure, Hindsight, Proposal
from specwire.generation.speculation.stats import SpeculationStats
from specwire.security.channels import RenewingChannel
from specwire.wire.generation_config import config_to_proto
from specwire.wire.tensors import tensor_from_proto

__all__ = ["DraftChannel", "RemoteDrafter"]

log = logging.getLogger("specwire.target_service.remote_drafter")

# How long a finished stream may take to end politely (half-close, the service's OK) before it is cancelled.
_GOODBYE_S = 5.0


class DraftChannel:
    """The draft service's `grpc.aio` channel, on an event loop thread of its own.

    Started on first use; `close()` cancels the streams still open, closes the channel and ends the
    thread. Coroutines run there through `run()`, in the caller's context (the draft stream's client
    span is a child of the request's span).

    Args:
        address (`str`): the draft service (`host:port` or `dns:///name:port`).
    """

    def __init__(self, address: str):
        self.address = address
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Renewed when the TLS files change; a draft stream lasts at most its request's deadline, and the
        # clients' default deadline is 600 s.
        self._channel = RenewingChannel(address, pb_grpc.DraftServiceStub, retire_grace_s=600.0)
        self._closed = False
        self.calls: set[Any] = set()  # open draft streams (on the loop's thread only)

    def _schedule(self, coro: Coroutine, start: bool) -> concurrent.futures.Future | None:
        """Schedule `coro` on the loop (started first if `start`); None when closed or not started."""
        with self._lock:
            if self._loop is None and start and not self._closed:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, daemon=True, name="specwire-draft-io")
                thread.start()
                self._loop, self._thread = loop, thread
            if self._closed or self._loop is None:
                coro.close()
                return None
            # Scheduled under the lock: `close()` schedules its shutdown after everything scheduled here.
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the channel's loop and wait up to `timeout` seconds for its result.

        Raises `DraftFailure` when the channel is closed or the coroutine was cancelled, and
        `TimeoutError` (after cancelling the coroutine) when it takes longer than `timeout`.
        """
        future = self._schedule(coro, start=True)
        if future is None:
            raise DraftFailure("the target service is shutting down")
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None
        except concurrent.futures.CancelledError:
            raise DraftFailure("the draft stream was cancelled") from None

    @property
    def open_streams(self) -> int:
        """Draft streams opened and not yet ended (observability and tests)."""
        return len(self.calls)

    def submit(self, coro: Coroutine) -> None:
        """Run `coro` on the channel's loop without waiting (nothing if the channel is closed)."""
        self._schedule(coro, start=False)

    def begin(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the channel's loop (started first if needed) without waiting: its future.

        Raises `DraftFailure` when the channel is closed."""
        future = self._schedule(coro, start=True)
        if future is None:
            raise DraftFailure("the target service is shutting down")
        return future

    def stub(self) -> pb_grpc.DraftServiceStub:
        """The stub (call on the channel's loop only: a grpc.aio channel belongs to the loop it was made on)."""
        return self._channel.stub()

    async def _shutdown(self) -> None:
        for call in list(self.calls):
            call.cancel()
        self.calls.clear()
        await self._channel.close()
        # What is still pending on the loop (a goodbye, gRPC's own tasks of a cancelled call) ends here, before
        # the loop closes: a task left pending on a closed loop is destroyed later, and a completion gRPC
        # delivers to a closed loop fails; both are logged as errors.
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=_GOODBYE_S)
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            if loop is None:
                return
            shutdown = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            shutdown.result(10)
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("closing the draft channel failed")
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10)
        loop.close()


class RemoteDrafter:
    """A `Drafter` behind a DraftService stream (a `grpc.aio` call on a `DraftChannel`): the draft service's model
    (`DRAFT_METHOD_MODEL`; the target runs prompt lookup itself).

    Args:
        channel (`DraftChannel`): the draft service's channel.
        rows (`list[list[int]]`): each row's tokens so far.
        config (`GenerationConfig`): the request's resolved config (processors, sampling).
        vocab_size (`int`): the target's vocabulary size.
        return_probs (`bool`): ask for the draft's probabilities (the target samples).
        round_timeout_s (`float`): deadline of each answer.
        deadline (`float`, *optional*): the caller's deadline (`specwire.deadline`, `time.monotonic()`
            clock): the stream's deadline, and every round waits at most until then.
        overlap (`bool`, defaults to `False`): ask the draft service to draft each next block ahead
            while the target verifies (`DraftStart.overlap`).
        stats (`SpeculationStats`, *optional*): receives the hits and misses of the blocks drafted ahead.
        digest (`tuple[int, bytes]`, *optional*): the target tokenizer's size and `tokenizer_digest`, sent
            so that a draft with another vocabulary is refused.
    """

    def __init__(
        self,
        channel,
        rows,
        config,
        vocab_size,
        return_probs,
        round_timeout_s,
        deadline=None,
        overlap: bool = False,
        stats: SpeculationStats | None = None,
        digest: tuple[int, bytes] | None = None,
    ):
        self.channel = channel
        self.timeout = round_timeout_s
        self.deadline = deadline
        self.num_rows = len(rows)
        self.vocab_size = vocab_size
        start = pb.DraftStart(
            rows=[common_pb2.TokenSequence(ids=r) for r in rows],
            method=pb.DRAFT_METHOD_MODEL,
            config=config_to_proto(config),
            vocab_size=vocab_size,
            return_probs=return_probs,
            overlap=overlap,
        )
        if digest is not None:
            start.tokenizer_size, start.tokenizer_digest = digest
        self.start: pb.DraftStart | None = start  # sent with the first propose
        self.before_start: list[list[int]] = [[] for _ in rows]  # tokens the target emitted before the first propose
        self.stats = stats
        self.pending: pb.DraftFeedback | None = None
        self.call: Any = None
        self.closed = False
        self.failed = False  # a round failed: close() cancels instead of ending politely
        self.early: concurrent.futures.Future | None = None  # the answer to a DraftStart sent by `prefill()`
        self.channel.run(self._open())

    async def _open(self) -> None:
        # Opened on the channel's loop (the call belongs to it), in the request's context (tracing).
        self.call = self.channel.stub().Draft(timeout=remaining(deadline=self.deadline))
        self.channel.calls.add(self.call)

    async def _exchange(self, message: pb.DraftRequest) -> pb.DraftResponse:
        try:
            await self.call.write(message)
            answer = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise DraftFailure(f"{exc.code().name}: {exc.details()}") from None
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            raise DraftFailure(f"the draft stream ended: {exc}") from None
        if answer is grpc.aio.EOF:
            raise DraftFailure("the draft stream ended")
        return answer

    def prefill(self) -> None:
        """Send the `DraftStart` now, asking for no drafts: the draft service catches up on the rows (the
        prompt's prefill) while the target goes on; the first `propose` reads its answer, and the target's
        tokens until then reach the draft service as that propose's feedback (checked in hindsight)."""
        if self.start is None or self.closed:
            return
        self.start.num_tokens = 0
        start, self.start = self.start, None
        self.early = self.channel.begin(self._exchange(pb.DraftRequest(start=start)))

    @property
    def prefilled(self) -> bool:
        """Whether the draft service has answered the `DraftStart` sent by `prefill()` (or none was sent)."""
        return self.early is None or self.early.done()

    def _answer_to_prefill(self, early: concurrent.futures.Future) -> None:
        """Wait for the answer to `prefill()`'s `DraftStart` (within the round deadline) and check it."""
        timeout = remaining(self.timeout, deadline=self.deadline)
        try:
            self._proposal(early.result(timeout), 0)
        except concurrent.futures.TimeoutError:
            self.failed = True
            raise DraftFailure(f"the draft's prefill took longer than the {timeout:.2f}s round deadline") from None
        except (DraftFailure, concurrent.futures.CancelledError) as exc:
            self.failed = True
            raise DraftFailure(str(exc) or "the draft stream was cancelled") from None

    def propose(self, num_tokens: int) -> Proposal:
        if self.closed:
            raise DraftFailure("the draft stream is closed")
        if self.early is not None:
            early, self.early = self.early, None
            self._answer_to_prefill(early)
        if self.start is not None and num_tokens == 0 and any(self.before_start):
            # A look-back before any block: the session opens on the prompt alone, then hears the target's
            # tokens as feedback, so the draft service checks its guesses of them (hindsight) rather than
            # taking them for prompt.
            self._ask(pb.DraftRequest(start=self.start), 0)
            self.start = None
            self.pending = pb.DraftFeedback(
                rows=[pb.RowFeedback(num_accepted=0, appended_ids=tokens) for tokens in self.before_start]
            )
        if self.start is not None:
            # Nothing proposed yet, so nothing accepted: the session starts further on. (A row finished by
            # then is still drafted for in the first block; the target drops those drafts.)
            for row, tokens in zip(self.start.rows, self.before_start, strict=True):
                row.ids.extend(tokens)
            self.start.num_tokens = num_tokens
            message = pb.DraftRequest(start=self.start)
            self.start = None
        else:
            feedback = self.pending or pb.DraftFeedback()
            feedback.num_tokens = num_tokens
            message = pb.DraftRequest(feedback=feedback)
            self.pending = None
        return self._ask(message, num_tokens)

    def _ask(self, message: pb.DraftRequest, num_tokens: int) -> Proposal:
        timeout = remaining(self.timeout, deadline=self.deadline)  # min(--draft-timeout, the caller's time)
        try:
            answer = self.channel.run(self._exchange(message), timeout=timeout)
            return self._proposal(answer, num_tokens)
        except TimeoutError:
            self.failed = True
            raise DraftFailure(f"no draft within the {timeout:.2f}s round deadline") from None
        except DraftFailure:
            self.failed = True
            raise

    def _proposal(self, answer: pb.DraftResponse, num_tokens: int) -> Proposal:
        """The answer as a `Proposal`, checked: a bad answer must not reach the target's forward."""
        if len(answer.rows) != self.num_rows:
            raise DraftFailure(f"the draft service answered {len(answer.rows)} rows for {self.num_rows}")
        tokens, probs, hindsight = [], [], []
        for row in answer.rows:
            ids = list(row.token_ids)
            if len(ids) > num_tokens:
                raise DraftFailure(f"the draft service answered {len(ids)} tokens (asked {num_tokens})")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise DraftFailure(f"the draft service answered ids outside [0, {self.vocab_size}): {ids}")
            row_probs = None
            if row.HasField("probs"):
                row_probs = tensor_from_proto(row.probs)
                if tuple(row_probs.shape) != (len(ids), self.vocab_size):
                    raise DraftFailure(
                        f"draft probabilities of shape {tuple(row_probs.shape)}, not {(len(ids), self.vocab_size)}"
                    )
            seen = Hindsight(row.hindsight_checked, row.hindsight_kept, row.hindsight_confident)
            if min(seen) < 0 or not seen.kept <= seen.confident <= seen.checked:
                raise DraftFailure(f"the draft service's hindsight does not add up: {seen}")
            tokens.append(ids)
            probs.append(row_probs)
            hindsight.append(seen)
        hits = sum(1 for r in answer.rows if r.ahead == pb.DRAFT_AHEAD_HIT)
        misses = sum(1 for r in answer.rows if r.ahead == pb.DRAFT_AHEAD_MISS)
        if self.stats is not None:  # counted once the answer is known good
            self.stats.draft_ahead_hits += hits
            self.stats.draft_ahead_misses += misses
        return Proposal(tokens, probs, hindsight, ahead_hit=hits > 0 and not misses)

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        """Kept for the next `propose` to send: every round's, rounds without a proposal included (the
        controller's time off), so the draft service sees every token the target emitted."""
        if self.start is not None:
            for row_tokens, tokens in zip(self.before_start, appended, strict=True):
                row_tokens.extend(tokens)
            return
        if self.pending is None:
            self.pending = pb.DraftFeedback(
                rows=[
                    pb.RowFeedback(num_accepted=n, appended_ids=a, finished=f)
                    for n, a, f in zip(num_accepted, appended, finished, strict=True)
                ]
            )
            return
        # The rounds since the last proposal accepted none of it: their tokens follow the pending ones.
        for row, tokens, done in zip(self.pending.rows, appended, finished, strict=True):
            row.appended_ids.extend(tokens)
            row.finished = row.finished or done

    def close(self) -> None:
        """End the stream (idempotent, never blocks): the draft service frees the session at once."""
        if self.closed:
            return
        self.closed = True
        self.channel.submit(self._goodbye())

    async def _goodbye(self) -> None:
        call = self.call
        try:
            if self.early is not None and not self.failed:  # one read at a time: the prefill's answer first
                await asyncio.wait_for(asyncio.wrap_future(self.early), _GOODBYE_S)
            if not self.failed:
                # Half-close and wait for the service's OK: the session ends cleanly (and the stream's
                # client span with it); a service that does not answer in time is cancelled.
                await asyncio.wait_for(self._drain(call), _GOODBYE_S)
        except BaseException:  # noqa: BLE001 - any failure ends in a cancel
            pass
        finally:
            call.cancel()
            self.channel.calls.discard(call)

    @staticmethod
    async def _drain(call) -> None:
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
