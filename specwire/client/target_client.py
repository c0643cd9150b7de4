"""Clients of the target service: `TargetClient` (blocking) and `AsyncTargetClient` (asyncio).

`generate()` mirrors `model.generate()`: `input_ids`/`attention_mask` as tensors or nested lists (or
`text`), GenerationConfig fields as keyword arguments, and an output with transformers' field names
(`sequences`, `scores`, `logits`, `beam_indices`, `sequences_scores`) as torch tensors, plus `text`,
`finish_reasons` and `speculation`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import torch

from specwire.client.config_client import config_to_wire
from specwire.client.errors import SpecwireRpcError, Violation, raises_rpc_errors
from specwire.client.retrying import RetrySchedule, acall_with_retries, call_with_retries, check_retries
from specwire.client.structured_output import structured_output_to_proto
from specwire.client.watermark import WatermarkDetection, build_detect_request
from specwire.common.v1 import common_pb2
from specwire.generation.outputs import compute_transition_scores as _compute_transition_scores
from specwire.security.channels import DEFAULT_CLIENT_MAX_MESSAGE_BYTES, secure_channel
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.vocabulary import (
    DRAFT_LENGTH_SOURCE_UNSPECIFIED,
    FINISH_UNSPECIFIED,
    PROPOSER_NONE,
    PROPOSER_UNSPECIFIED,
)
from specwire.wire.common import FINISH_REASON_FROM_PROTO
from specwire.wire.generation_config import config_from_proto
from specwire.wire.proposers import DRAFT_LENGTH_SOURCE_FROM_PROTO, PROPOSER_FROM_PROTO, PROPOSER_TO_PROTO
from specwire.wire.tensors import tensor_from_proto

# A request's `proposer` argument -> the wire's enum; None leaves the choice to the target.
PROPOSERS: dict[str | None, pb.Proposer] = dict([(None, pb.PROPOSER_UNSPECIFIED), *PROPOSER_TO_PROTO.items()])


@dataclass
class SpeculationStats:
    """Speculative decoding statistics of one request.

    `draft_length_source` says who chose the draft lengths (`controller`, `schedule`, or `unspecified`
    when the request did not speculate); `draft_lengths` holds the length asked each round, run-length
    encoded as `(length, rounds)` in round order (`round_lengths()` expands it), 0 for a round without a
    draft; `tokens_without_draft` counts the tokens decoded while the controller took time off, and
    `probes` the short drafts it tried after it.
    """

    proposer: str = PROPOSER_NONE
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback_reason: str = ""
    # A remote draft with overlap: rows answered from the block drafted ahead / whose block was discarded.
    draft_ahead_hits: int = 0
    draft_ahead_misses: int = 0
    draft_length_source: str = DRAFT_LENGTH_SOURCE_UNSPECIFIED
    draft_lengths: list[tuple[int, int]] = field(default_factory=list)
    draft_length_rounds_dropped: int = 0
    tokens_without_draft: int = 0
    probes: int = 0

    def round_lengths(self) -> list[int]:
        """The draft length asked each round, in order (the runs of `draft_lengths` expanded)."""
        return [length for length, rounds in self.draft_lengths for _ in range(rounds)]

    @classmethod
    def from_proto(cls, message: pb.SpeculationStats) -> SpeculationStats:
        return cls(
            proposer=PROPOSER_FROM_PROTO.get(message.proposer, PROPOSER_UNSPECIFIED),
            rounds=message.rounds,
            drafted_tokens=message.drafted_tokens,
            accepted_tokens=message.accepted_tokens,
            acceptance_rate=message.acceptance_rate,
            accepted_by_position=list(message.accepted_by_position),
            draft_seconds=message.draft_seconds,
            verify_seconds=message.verify_seconds,
            fallback_reason=message.fallback_reason,
            draft_ahead_hits=message.draft_ahead_hits,
            draft_ahead_misses=message.draft_ahead_misses,
            draft_length_source=DRAFT_LENGTH_SOURCE_FROM_PROTO.get(
                message.draft_length_source, DRAFT_LENGTH_SOURCE_UNSPECIFIED
            ),
            draft_lengths=[(run.length, run.rounds) for run in message.draft_lengths],
            draft_length_rounds_dropped=message.draft_length_rounds_dropped,
            tokens_without_draft=message.tokens_without_draft,
            probes=message.probes,
        )


@dataclass
class GenerateOutput:
    """A generation's output with transformers' field names (torch tensors) plus text and reasons."""

    sequences: torch.Tensor  # [rows, T]
    text: list[str]
    finish_reasons: list[str]
    scores: tuple[torch.Tensor, ...] | None = None  # steps x [rows (x beams), vocab]
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None  # [rows, generated]
    sequences_scores: torch.Tensor | None = None  # [rows]
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    config_name: str = ""
    config_version: int = 0
    model_id: str = ""
    warnings: list[Violation] = field(default_factory=list)
    prompt_length: int = 0  # `sequences[:, prompt_length:]` are the generated tokens
    # `output_attentions` / `output_hidden_states`: steps x layers x tensor, as transformers returns them.
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None  # [rows, heads, query, key]
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None  # [rows, query, hidden]

    @classmethod
    def from_proto(cls, response: pb.GenerateResponse) -> GenerateOutput:
        def tensor(name: str) -> torch.Tensor | None:
            return tensor_from_proto(getattr(response, name)) if response.HasField(name) else None

        def steps(name: str) -> tuple[torch.Tensor, ...] | None:
            stacked = tensor(name)
            return None if stacked is None else tuple(stacked.unbind(0))

        def layered(name: str) -> tuple[tuple[torch.Tensor, ...], ...] | None:
            entries = getattr(response, name)
            if not entries:
                return None
            return tuple(tuple(tensor_from_proto(layer) for layer in step.layers) for step in entries)

        return cls(
            sequences=torch.tensor([list(s.token_ids) for s in response.sequences], dtype=torch.long),
            text=[s.text for s in response.sequences],
            finish_reasons=[
                FINISH_REASON_FROM_PROTO.get(s.finish_reason, FINISH_UNSPECIFIED) for s in response.sequences
            ],
            scores=steps("scores"),
            logits=steps("logits"),
            beam_indices=None
            if not response.HasField("beam_indices")
            else cast(torch.Tensor, tensor("beam_indices")).long(),
            sequences_scores=tensor("sequences_scores"),
            speculation=SpeculationStats.from_proto(response.speculation),
            config_name=response.config.name,
            config_version=response.config.version,
            model_id=response.model_id,
            warnings=[Violation.from_proto(w) for w in response.warnings],
            prompt_length=max((s.prompt_length for s in response.sequences), default=0),
            attentions=layered("attentions"),
            hidden_states=layered("hidden_states"),
        )


@dataclass
class StreamDelta:
    """Tokens and text one output row gained in one step."""

    row: int
    token_ids: list[int]
    text: str


def _rows(value: Any) -> list[list[int]] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if value and isinstance(value[0], int):
        value = [value]
    return [list(map(int, row)) for row in value]


def build_request(
    request_type,
    input_ids=None,
    *,
    text=None,
    attention_mask=None,
    generation_config=None,
    apply_chat_template: bool = False,
    negative_prompt_ids=None,
    proposer: str | None = None,
    request_id: str = "",
    use_model_defaults: bool | None = None,
    structured_output=None,
    allowed_token_sequences=None,
    processors=None,
    stopping_criteria=None,
    generate_method=None,
    **kwargs,
):
    """A GenerateRequest / GenerateStreamRequest from `generate()`-style arguments (`structured_output`:
    see `specwire.client.structured_output`)."""
    if input_ids is not None and text is not None:
        raise ValueError("pass input_ids or text, not both (neither: generate from bos_token_id)")
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(k for k in PROPOSERS if k)}, not {proposer!r}")
    request = request_type(apply_chat_template=apply_chat_template, proposer=PROPOSERS[proposer], request_id=request_id)
    if text is not None:
        for item in [text] if isinstance(text, str) else text:
            request.prompts.add(text=item)
    elif input_ids is not None:  # neither: no prompt, the target starts from bos_token_id
        masks = _rows(attention_mask) or []
        for i, row in enumerate(cast(list[list[int]], _rows(input_ids))):  # no text: token ids were given
            prompt = request.prompts.add(token_ids=common_pb2.TokenSequence(ids=row))
            if masks:
                prompt.attention_mask.extend(masks[i])
    if use_model_defaults is not None:
        request.use_model_defaults = bool(use_model_defaults)
    if isinstance(generation_config, str):
        request.config_ref = generation_config
    elif generation_config is not None:
        request.config.CopyFrom(config_to_wire(generation_config))
    if kwargs:
        request.overrides.CopyFrom(config_to_wire(dict(kwargs)))
    if negative_prompt_ids is not None:
        request.negative_prompt.token_ids.ids.extend(cast(list[list[int]], _rows(negative_prompt_ids))[0])
    if structured_output is not None:
        request.structured_output.CopyFrom(structured_output_to_proto(structured_output))
    for sequence in _rows(allowed_token_sequences) or []:
        request.allowed_token_sequences.add(ids=sequence)
    for field_name, calls in (("processors", processors), ("stopping_criteria", stopping_criteria)):
        for call in _plugin_calls(field_name, calls):
            getattr(request, field_name).append(call)
    if generate_method is not None:
        (call,) = _plugin_calls("generate_method", [generate_method])
        request.generate_method.CopyFrom(call)
    return request


def _plugin_calls(field_name: str, calls) -> list[pb.PluginCall]:
    """`[{"name": ..., "args": {...}}, ...]` (or bare names) as `PluginCall` messages: server plugins
    named by their entry-point names, their arguments sent as JSON."""
    out = []
    for i, call in enumerate(calls or []):
        if isinstance(call, str):
            call = {"name": call}
        if callable(call) or not isinstance(call, Mapping) or set(call) - {"name", "args"} or "name" not in call:
            raise ValueError(
                f"{field_name}[{i}] must be a dict {{'name': plugin, 'args': {{...}}}} naming a server plugin "
                f"(GetModelInfo lists them), got {call!r}: Python callables cannot travel to the server"
            )
        out.append(pb.PluginCall(name=str(call["name"]), args_json=json.dumps(call.get("args") or {})))
    return out


# A generation's default deadline: generous (a long generation on a CPU takes minutes), but finite, so
# that a hung or lost server never blocks its caller forever. `timeout=None` means no deadline.
DEFAULT_TIMEOUT_S = 600.0
_CLIENT_DEFAULT: Any = object()  # a call's `timeout` when not given: the client's


def _deltas(message: pb.TokenDelta) -> list[StreamDelta]:
    return [StreamDelta(r.row, list(r.token_ids), r.text) for r in message.rows]


class TargetClient:
    """Blocking client of `specwire.target.v1.TargetService`.

    Args:
        address (`str`): the target service: any gRPC target. `host:port` (one replica, or a ClusterIP
            Service: every call rides one connection to one pod), `dns:///name:port` (every address the
            name resolves to, e.g. a headless Service's pods), `ipv4:a.b.c.d:port,e.f.g.h:port` or
            `ipv6:[a::1]:port,...` (a fixed list of replicas).
        timeout (`float`, *optional*, defaults to 600.0): deadline of each call in seconds (None: no
            deadline); every method takes `timeout=` to override it for one call.
        max_message_bytes (`int`, defaults to 16 MiB): largest response accepted (scores and logits of
            long generations need more).
        retries (`int`, defaults to 0): how many times a call the target refused for load
            (RESOURCE_EXHAUSTED with a retry hint, before any work) is sent again after the hinted wait,
            within the call's timeout; a stream only before its first message. 0: never.
        token (`str`, *optional*): bearer token sent with every call (a reader token is enough to
            generate); default `SPECWIRE_AUTH_TOKEN`; "" sends none.
        allow_insecure_token (`bool`, *optional*): send the token in plaintext to a non-loopback address
            (refused otherwise: set `SPECWIRE_TLS_CA_FILE`); default `SPECWIRE_ALLOW_INSECURE_TOKEN`.
        load_balancing (`str`, *optional*): `"round_robin"` (each call to the next ready address) or
            `"pick_first"` (every call to one address); default `round_robin` for `dns:///` targets and
            address lists, `pick_first` for one `host:port`.

    Several replicas: with `round_robin` each call goes to the next ready replica, and a replica that
    goes away is skipped from then on. Calls in flight on a replica that dies fail with UNAVAILABLE and
    are not sent again (generation is not idempotent: it may have run, and a sampled output is not
    repeatable): send them again yourself if you want. `retries=` resends only load refusals. A call no
    replica took up yet (the target sends its response headers when it admits a request) is resent by
    the channel: one refused unread or cancelled unhandled by a draining replica, or one whose replica
    died before admitting it (`specwire.security.channels.UNSTARTED_RETRY_POLICY`).
    """

    def __init__(
        self,
        address: str = "127.0.0.1:50052",
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES,
        retries: int = 0,
        *,
        token: str | None = None,
        allow_insecure_token: bool | None = None,
        load_balancing: str | None = None,
    ):
        self.retries = check_retries(retries)
        self.channel = secure_channel(
            address,
            max_message_bytes=max_message_bytes,
            token=token,
            allow_insecure_token=allow_insecure_token,
            load_balancing=load_balancing,
        )
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.timeout = timeout

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is _CLIENT_DEFAULT else timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @raises_rpc_errors
    def generate(
        self,
        input_ids=None,
        *,
        text=None,
        attention_mask=None,
        generation_config=None,
        timeout: float | None = _CLIENT_DEFAULT,
        **kwargs,
    ) -> GenerateOutput:
        """Like `model.generate()` (no `input_ids` and no `text`: one row from `bos_token_id`, as
        `model.generate()` does without inputs). `generation_config` may be ours, transformers', a dict or a registry
        reference (`name`, `name@3`, `name:prod`); keyword arguments are GenerationConfig fields that win
        over it. Also: `apply_chat_template`, `negative_prompt_ids`, `proposer`, `request_id`,
        `use_model_defaults` (False: the model's generation_config.json is skipped but for its special
        tokens),
        `structured_output` (`{"json_schema": dict or pydantic model class}`, `{"regex": str}`,
        `{"grammar": str}` or `{"choice": [str, ...]}`: the output must match it),
        `allowed_token_sequences` (lists of token ids: the generated tokens follow one of them, then EOS;
        transformers' `prefix_allowed_tokens_fn` as data), `processors` and `stopping_criteria`
        (`[{"name": plugin, "args": {...}}, ...]`: server plugins the target enabled, transformers'
        `logits_processor` and `stopping_criteria` as data), `generate_method` (`{"name": plugin, "args":
        {...}}`: a server plugin generate method, transformers' `custom_generate` as data), and `timeout` (this
        call's deadline in seconds, None for none; default: the client's)."""
        request = build_request(
            pb.GenerateRequest,
            input_ids,
            text=text,
            attention_mask=attention_mask,
            generation_config=generation_config,
            **kwargs,
        )
        response = call_with_retries(
            lambda left: self.stub.Generate(request, timeout=left), self.retries, self._timeout(timeout)
        )
        return GenerateOutput.from_proto(response)

    def stream(
        self,
        input_ids=None,
        *,
        text=None,
        attention_mask=None,
        generation_config=None,
        timeout: float | None = _CLIENT_DEFAULT,
        **kwargs,
    ) -> Iterator[StreamDelta | GenerateOutput]:
        """Yield `StreamDelta`s as tokens are produced, then the final `GenerateOutput`.
        Breaking out of the loop cancels the request on the server."""
        request = build_request(
            pb.GenerateStreamRequest,
            input_ids,
            text=text,
            attention_mask=attention_mask,
            generation_config=generation_config,
            **kwargs,
        )
        schedule = RetrySchedule(self.retries, self._timeout(timeout))
        while True:
            call = self.stub.GenerateStream(request, timeout=schedule.timeout())
            started = False
            try:
                for message in call:
                    started = True
                    if message.HasField("final"):
                        yield GenerateOutput.from_proto(message.final)
                    else:
                        yield from _deltas(message.delta)
                return
            except grpc.RpcError as exc:
                # Refused for load before its first message: nothing was generated, it can be sent again.
                wait = None if started else schedule.wait_after(exc)
                if wait is None:
                    raise SpecwireRpcError.from_rpc_error(exc) from None
            finally:
                call.cancel()
            time.sleep(wait)

    @raises_rpc_errors
    def model_info(self, timeout: float | None = _CLIENT_DEFAULT) -> pb.GetModelInfoResponse:
        """The served model's id, vocabulary, special tokens and generation config."""
        return call_with_retries(
            lambda left: self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=left),
            self.retries,
            self._timeout(timeout),
        )

    @raises_rpc_errors
    def detect_watermark(
        self, input_ids=None, *, text=None, timeout: float | None = _CLIENT_DEFAULT, **kwargs
    ) -> WatermarkDetection:
        """Score rows of token ids (`input_ids`: a list, nested lists or a tensor) or `text` for a watermark.

        Keyword arguments: `watermarking_config` (a dict or transformers' (SynthID)WatermarkingConfig) or
        `generation_config` (a registry reference or a config holding one), `z_threshold` (default 3.0),
        `ignore_repeated_ngrams`, `request_id`. Green list: the fields of transformers'
        `WatermarkDetector(...)(ids, return_dict=True)`, one entry per row; SynthID: `mean_score`.
        """
        request = build_detect_request(input_ids, text=text, **kwargs)
        response = call_with_retries(
            lambda left: self.stub.DetectWatermark(request, timeout=left), self.retries, self._timeout(timeout)
        )
        return WatermarkDetection.from_proto(response)

    def model_generation_config(self):
        """The served model's generation_config.json as our GenerationConfig."""
        return config_from_proto(self.model_info().generation_config)

    def request_limits(self) -> pb.RequestLimits:
        """What one request may ask of this target (`max_model_len`, `max_new_tokens`, ...), as `GetModelInfo`
        reports them: check a request against them before sending it."""
        return self.model_info().limits

    @staticmethod
    def compute_transition_scores(sequences, scores, beam_indices=None, normalize_logits: bool = False):
        """Same as transformers' `model.compute_transition_scores`."""
        return _compute_transition_scores(sequences, scores, beam_indices, normalize_logits)


class AsyncTargetClient:
    """asyncio client of `specwire.target.v1.TargetService`; same arguments and methods as `TargetClient`,
    awaitable."""

    def __init__(
        self,
        address: str = "127.0.0.1:50052",
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES,
        retries: int = 0,
        *,
        token: str | None = None,
        allow_insecure_token: bool | None = None,
        load_balancing: str | None = None,
    ):
        self.retries = check_retries(retries)
        self.channel = secure_channel(
            address,
            aio=True,
            max_message_bytes=max_message_bytes,
            token=token,
            allow_insecure_token=allow_insecure_token,
            load_balancing=load_balancing,
        )
        self.stub = pb_grpc.TargetServiceStub(self.channel)
        self.timeout = timeout

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is _CLIENT_DEFAULT else timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTargetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @raises_rpc_errors
    async def generate(
        self,
        input_ids=None,
        *,
        text=None,
        attention_mask=None,
        generation_config=None,
        timeout: float | None = _CLIENT_DEFAULT,
        **kwargs,
    ) -> GenerateOutput:
        request = build_request(
            pb.GenerateRequest,
            input_ids,
            text=text,
            attention_mask=attention_mask,
            generation_config=generation_config,
            **kwargs,
        )
        response = await acall_with_retries(
            lambda left: self.stub.Generate(request, timeout=left), self.retries, self._timeout(timeout)
        )
        return GenerateOutput.from_proto(response)

    async def stream(
        self,
        input_ids=None,
        *,
        text=None,
        attention_mask=None,
        generation_config=None,
        timeout: float | None = _CLIENT_DEFAULT,
        **kwargs,
    ) -> AsyncIterator[StreamDelta | GenerateOutput]:
        request = build_request(
            pb.GenerateStreamRequest,
            input_ids,
            text=text,
            attention_mask=attention_mask,
            generation_config=generation_config,
            **kwargs,
        )
        schedule = RetrySchedule(self.retries, self._timeout(timeout))
        while True:
            call = self.stub.GenerateStream(request, timeout=schedule.timeout())
            started = False
            try:
                async for message in call:
                    started = True
                    if message.HasField("final"):
                        yield GenerateOutput.from_proto(message.final)
                    else:
                        for delta in _deltas(message.delta):
                            yield delta
                return
            except grpc.RpcError as exc:
                wait = None if started else schedule.wait_after(exc)
                if wait is None:
                    raise SpecwireRpcError.from_rpc_error(exc) from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    @raises_rpc_errors
    async def model_info(self, timeout: float | None = _CLIENT_DEFAULT) -> pb.GetModelInfoResponse:
        return await acall_with_retries(
            lambda left: self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=left),
            self.retries,
            self._timeout(timeout),
        )

    @raises_rpc_errors
    async def detect_watermark(
        self, input_ids=None, *, text=None, timeout: float | None = _CLIENT_DEFAULT, **kwargs
    ) -> WatermarkDetection:
        """As `TargetClient.detect_watermark`."""
        request = build_detect_request(input_ids, text=text, **kwargs)
        response = await acall_with_retries(
            lambda left: self.stub.DetectWatermark(request, timeout=left), self.retries, self._timeout(timeout)
        )
        return WatermarkDetection.from_proto(response)

    async def request_limits(self) -> pb.RequestLimits:
        """What one request may ask of this target, as `GetModelInfo` reports them."""
        return (await self.model_info()).limits

    compute_transition_scores = staticmethod(TargetClient.compute_transition_scores)
