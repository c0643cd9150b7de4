"""`specwire.target.v1.TargetService`: Generate, GenerateStream, GetModelInfo and DetectWatermark."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import cast

import torch

from specwire import telemetry
from specwire.common.v1 import common_pb2
from specwire.errors import ResourceExhausted
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.plugins import PluginRegistry
from specwire.generation.speculation.stats import SpeculationStats
from specwire.models import LoadedModel
from specwire.serving import handles_errors
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.target_service.admission import PreparationPool
from specwire.target_service.config_resolver import ConfigResolver
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.engine import Engine
from specwire.target_service.limits import DEFAULT_MAX_MESSAGE_BYTES, RequestLimits
from specwire.target_service.observability import RequestObserver, SpecDecodeMetrics, load_gauges
from specwire.target_service.requests import GenerationJob, build_job
from specwire.target_service.scheduler.batch_scheduler import BatchScheduler
from specwire.target_service.scheduler.options import SchedulerKind, SchedulerOptions
from specwire.target_service.watermarks import detect
from specwire.wire.common import FINISH_REASON_TO_PROTO, violation_to_proto
from specwire.wire.generation_config import config_to_proto
from specwire.wire.proposers import DRAFT_LENGTH_SOURCE_TO_PROTO, PROPOSER_TO_PROTO
from specwire.wire.tensors import tensor_to_proto

log = logging.getLogger("specwire.target_service")


class TextDeltas:
    """Incremental detokenization per output row: emit only text that is complete UTF-8."""

    def __init__(self, tokenizer, rows: int):
        self.tokenizer = tokenizer
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.text: list[str] = [""] * rows

    def add(self, row: int, token_ids: list[int]) -> str:
        self.tokens[row].extend(token_ids)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens[row], skip_special_tokens=True)
        # A trailing U+FFFD is a multi-byte character cut in half: wait for its other bytes.
        if text.endswith("\ufffd") or not text.startswith(self.text[row]):
            return ""
        delta, self.text[row] = text[len(self.text[row]) :], text
        return delta

    def flush(self, row: int, final_text: str) -> str:
        """Text still held back when the row ended (a character that never completed)."""
        if not final_text.startswith(self.text[row]):
            return ""
        rest, self.text[row] = final_text[len(self.text[row]) :], final_text
        return rest


def peak_device_memory_bytes(device: torch.device) -> int:
    """Peak bytes torch's CUDA allocator has reserved on `device`; 0 for the CPU."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def speculation_to_proto(stats: SpeculationStats) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        proposer=PROPOSER_TO_PROTO.get(stats.proposer, pb.PROPOSER_UNSPECIFIED),
        rounds=stats.rounds,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        accepted_by_position=stats.accepted_by_position,
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        fallback_reason=stats.fallback_reason,
        draft_ahead_hits=stats.draft_ahead_hits,
        draft_ahead_misses=stats.draft_ahead_misses,
        draft_length_source=DRAFT_LENGTH_SOURCE_TO_PROTO.get(stats.decided_by, pb.DRAFT_LENGTH_SOURCE_UNSPECIFIED),
        draft_lengths=[pb.DraftLengthRun(length=length, rounds=rounds) for length, rounds in stats.length_runs],
        draft_length_rounds_dropped=stats.length_rounds_dropped,
        tokens_without_draft=stats.tokens_without_draft,
        probes=stats.probes,
    )


def response_from_result(result: GenerationResult, job: GenerationJob, loaded: LoadedModel) -> pb.GenerateResponse:
    """The wire form of a finished generation."""
    prompt_length = job.input_ids.shape[1]
    sequences = []
    for row, ids in enumerate(result.sequences.tolist()):
        generated = ids[prompt_length:]
        text = loaded.tokenizer.decode(generated, skip_special_tokens=True) if loaded.tokenizer is not None else ""
        sequences.append(
            pb.GeneratedSequence(
                token_ids=ids,
                prompt_length=prompt_length,
                text=text,
                finish_reason=FINISH_REASON_TO_PROTO.get(
                    result.finish_reasons[row], common_pb2.FINISH_REASON_UNSPECIFIED
                ),
            )
        )
    response = pb.GenerateResponse(
        sequences=sequences,
        model_id=loaded.model_id,
        warnings=[violation_to_proto(w) for w in job.warnings],
        speculation=speculation_to_proto(job.speculation),
    )
    if result.scores is not None:
        response.scores.CopyFrom(tensor_to_proto(torch.stack(result.scores).float()))
    if result.logits is not None:
        response.logits.CopyFrom(tensor_to_proto(torch.stack(result.logits).float()))
    if result.beam_indices is not None:
        response.beam_indices.CopyFrom(tensor_to_proto(result.beam_indices.to(torch.int32)))
    if result.sequences_scores is not None:
        response.sequences_scores.CopyFrom(tensor_to_proto(result.sequences_scores.float()))
    for name in ("attentions", "hidden_states"):
        for step in getattr(result, name) or ():
            getattr(response, name).add(layers=[tensor_to_proto(layer.float()) for layer in step])
    if job.resolved is not None:
        response.config.name = job.resolved.name
        response.config.version = job.resolved.version
    return response


class TargetServicer(pb_grpc.TargetServiceServicer):
    """The target service over one loaded model.

    Args:
        loaded (`LoadedModel`): the served model.
        resolver (`ConfigResolver`): registry lookups for `config_ref`.
        drafting (`DraftPolicy`, *optional*): speculation settings (draft service, default proposer).
        scheduler (`SchedulerKind` or its value, defaults to `SchedulerKind.BATCHED`): see `Engine`.
        scheduler_options (`SchedulerOptions`, *optional*): limits of the batched scheduler.
        limits (`RequestLimits`, *optional*): what one request may ask; defaults to
            `RequestLimits.for_model(...)` (`max_model_len` = the model's context).
        pool (`PreparationPool`, *optional*): where requests are validated and tokenized; defaults to
            2 workers and 16 preparations in flight; the servicer owns it (`close` stops it).
        max_message_bytes (`int`, defaults to 16 MiB): the server's message size limit, reported by
            `GetModelInfo` (the server options set it).
        stuck_after_s (`float`, defaults to 60.0): seconds without model progress while work waits
            before the service reports itself stuck (`liveness`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        resolver: ConfigResolver,
        drafting: DraftPolicy | None = None,
        scheduler: SchedulerKind | str = SchedulerKind.BATCHED,
        scheduler_options: SchedulerOptions | None = None,
        limits: RequestLimits | None = None,
        pool: PreparationPool | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stuck_after_s: float = 60.0,
        plugins: PluginRegistry | None = None,
    ):
        self.loaded = loaded
        self.plugins = plugins or PluginRegistry()  # the server plugins requests may name (`--plugins`)
        self.resolver = resolver
        self.engine = Engine(loaded, drafting, scheduler, scheduler_options, stuck_after_s)
        meter = telemetry.get_meter()
        self.metrics = SpecDecodeMetrics(meter)
        load_gauges(meter).watch(self.engine, loaded.model_id)
        self.limits = limits or RequestLimits.for_model(loaded.max_position_embeddings)
        self.pool = pool or PreparationPool()
        self.max_message_bytes = max_message_bytes

    def _admit(self) -> None:
        """The cheap capacity checks, before the request costs anything (no tokenizing, no validation)."""
        retry_after_s = self.engine.queue_full()
        if retry_after_s is not None:
            batcher = cast(BatchScheduler, self.engine.batcher)  # a full queue is the batched scheduler's
            queued, limit = batcher.stats().queued, batcher.options.max_queued
            raise ResourceExhausted(
                f"the target service is at capacity: {queued} requests queued (--max-queued {limit}); retry later",
                retry_after_s=retry_after_s,
            )
        self.pool.admit()

    def close(self) -> None:
        """Stop the engine's threads, after the server stopped: a daemon thread still in a forward when the
        interpreter finalizes is ended there (Python 3.11 ends a daemon thread that wakes for the GIL), and
        unwinding through torch's C++ frames aborts the process ("terminate called without an active exception")."""
        self.engine.close()
        self.pool.close()

    def liveness(self) -> str:
        """Why this service cannot generate now ("" when it can): the health watchdog's check."""
        return self.engine.problem()

    async def _run(
        self, request, context, rpc: str = "Generate"
    ) -> AsyncGenerator[tuple[GenerationJob, StepEvent | GenerationResult], None]:
        # The request's span (config lookup and draft stream are its children), round spans, metrics.
        with RequestObserver(self.metrics, self.loaded.model_id, rpc, request) as observed:
            self._admit()
            # Headers now: the call is taken up, so gRPC's retry policy never resends it from here on
            # (`specwire.security.channels.UNSTARTED_RETRY_POLICY`).
            await context.send_initial_metadata(())
            job = await build_job(
                request, self.loaded, self.resolver, self.limits, self.pool, self.plugins, self.engine.on_model_thread
            )
            observed.job_ready(job)
            started = time.perf_counter()
            async for item in self.engine.run(job):
                observed.item(item)
                if isinstance(item, GenerationResult):
                    # Logged before handing the result over: the caller closes this generator after it.
                    log.info(
                        "request %s: %d row(s), %d new tokens, in %.3fs",
                        job.request_id or "-",
                        item.sequences.shape[0],
                        item.sequences.shape[1] - item.prompt_length,
                        time.perf_counter() - started,
                    )
                yield job, item

    @handles_errors
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with aclosing(self._run(request, context)) as items:  # closed here, in this task
            async for job, item in items:
                if isinstance(item, GenerationResult):
                    return response_from_result(item, job, self.loaded)
        raise RuntimeError("decoding loop ended without a result")

    @handles_errors
    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        deltas: TextDeltas | None = None
        async with aclosing(self._run(request, context, "GenerateStream")) as items:
            async for job, item in items:
                if isinstance(item, GenerationResult):
                    final = response_from_result(item, job, self.loaded)
                    if deltas is not None:
                        rest = [
                            pb.RowDelta(row=row, text=deltas.flush(row, seq.text))
                            for row, seq in enumerate(final.sequences)
                        ]
                        rest = [r for r in rest if r.text]
                        if rest:
                            yield pb.GenerateStreamResponse(delta=pb.TokenDelta(rows=rest))
                    yield pb.GenerateStreamResponse(final=final)
                    return
                if deltas is None:
                    deltas = TextDeltas(self.loaded.tokenizer, len(item.tokens))
                rows = [
                    pb.RowDelta(row=row, token_ids=tokens, text=deltas.add(row, tokens))
                    for row, tokens in enumerate(item.tokens)
                    if tokens
                ]
                if rows:
                    yield pb.GenerateStreamResponse(delta=pb.TokenDelta(rows=rows))

    @handles_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        loaded = self.loaded
        config = loaded.generation_config
        eos = config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return pb.GetModelInfoResponse(
            model_id=loaded.model_id,
            vocab_size=loaded.vocab_size,
            bos_token_id=config.bos_token_id,
            eos_token_ids=eos_ids,
            pad_token_id=config.pad_token_id,
            max_position_embeddings=loaded.max_position_embeddings or 0,
            generation_config=config_to_proto(config),
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            # A wrapper (the tensor-parallel `MirroredModel`) names the model it wraps.
            architecture=getattr(loaded.model, "architecture", None) or type(loaded.model).__name__,
            peak_device_memory_bytes=peak_device_memory_bytes(loaded.device),
            limits=limits_to_proto(self.limits, self.max_message_bytes),
            plugins=[pb.PluginInfo(name=p.name, kind=p.kind, description=p.description) for p in self.plugins.all()],
        )

    @handles_errors
    async def DetectWatermark(self, request: pb.DetectWatermarkRequest, context) -> pb.DetectWatermarkResponse:
        self.pool.admit()
        started = time.perf_counter()
        response = await detect(request, self.loaded, self.resolver, self.limits, self.pool)
        log.info(
            "request %s: watermark detection over %d row(s) in %.3fs",
            request.request_id or "-",
            len(response.rows),
            time.perf_counter() - started,
        )
        return response


def limits_to_proto(limits: RequestLimits, max_message_bytes: int) -> pb.RequestLimits:
    """The limits in force, as `GetModelInfo` reports them (0 = no separate cap)."""
    return pb.RequestLimits(
        max_model_len=limits.max_model_len,
        max_new_tokens=limits.max_new_tokens or 0,
        max_request_rows=limits.max_request_rows,
        max_prompts=limits.max_prompts,
        max_beams=limits.max_beams,
        max_stop_strings=limits.max_stop_strings,
        max_stop_string_chars=limits.max_stop_string_chars,
        max_bias_entries=limits.max_bias_entries,
        max_output_bytes=limits.max_output_bytes,
        max_prompt_chars=limits.max_prompt_chars,
        max_message_bytes=max_message_bytes,
    )
