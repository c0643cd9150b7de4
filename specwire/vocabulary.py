"""The words every side of specwire shares: proposer names, finish reasons and metric names.

The services, the client, the decoding core and the benchmarks spell these the same way, so they are
defined here once. Standard library only: the `specwire` CLI imports it at start-up (no torch, no
gRPC), and the pure core may import it too.

The wire's enums follow one naming rule, `PROPOSER_<NAME>` (`specwire.target.v1.Proposer`) and
`FINISH_REASON_<NAME>` (`specwire.common.v1.FinishReason`), so `specwire.wire` derives its enum
mappings from the names here (and fails at import if a name has no enum value).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

# ---------------------------------------------------------------------------------------------------
# Proposers: who drafts tokens for speculative decoding. The values of `--proposer`,
# `--default-proposer`, `SpeculationStats.proposer` and the `proposer` metric label.
# ---------------------------------------------------------------------------------------------------

PROPOSER_NONE: Final = "none"
PROPOSER_PROMPT_LOOKUP: Final = "prompt_lookup"
PROPOSER_DRAFT_MODEL: Final = "draft_model"
# Self-speculation: the target's first `assistant_early_exit` layers draft (a request's choice only: it needs
# the request's layer count, so it is no server default).
PROPOSER_EARLY_EXIT: Final = "early_exit"
# Multi-token prediction: the target's own MTP layers draft from its last hidden states (`use_mtp`; a request's
# choice only, like early exit: only a model whose checkpoint has MTP layers can run it).
PROPOSER_MTP: Final = "mtp"
# DFlash: a block-diffusion assistant loaded next to the target (`--dflash-model`) drafts from the target's hidden
# states (`speculation_type="dflash"`, which selects it; a request's choice only).
PROPOSER_DFLASH: Final = "dflash"
PROPOSERS: Final = (
    PROPOSER_NONE,
    PROPOSER_PROMPT_LOOKUP,
    PROPOSER_DRAFT_MODEL,
    PROPOSER_EARLY_EXIT,
    PROPOSER_MTP,
    PROPOSER_DFLASH,
)
# What a client shows for the wire's zero value (a response that names no proposer).
PROPOSER_UNSPECIFIED: Final = "unspecified"

# Who chose a request's draft lengths (`SpeculationStats.decided_by`, the wire's `DraftLengthSource`,
# `DRAFT_LENGTH_SOURCE_<NAME>`): the adaptive controller, or a schedule (named by the request, or the
# server's constant one when the controller is off).
DRAFT_LENGTH_CONTROLLER: Final = "controller"
DRAFT_LENGTH_SCHEDULE: Final = "schedule"
DRAFT_LENGTH_SOURCES: Final = (DRAFT_LENGTH_CONTROLLER, DRAFT_LENGTH_SCHEDULE)
# What a client shows for the wire's zero value (a request that did not speculate, an older server).
DRAFT_LENGTH_SOURCE_UNSPECIFIED: Final = "unspecified"

# ---------------------------------------------------------------------------------------------------
# Finish reasons: why a row stopped. Results, step events, the client's `finish_reasons` and the
# `gen_ai.response.finish_reasons` span attribute carry the names; stopping criteria compute the
# `FinishReason` codes on tensors.
# ---------------------------------------------------------------------------------------------------

FINISH_LENGTH: Final = "length"
FINISH_EOS: Final = "eos"
FINISH_STOP_STRING: Final = "stop_string"
FINISH_TIME: Final = "time"
# A server plugin stopping criterion (`specwire.generation.plugins`) the request named ended the row.
FINISH_STOPPING_CRITERION: Final = "stopping_criterion"
# The decoding loops report only the five above; the wire has one more for a cancelled request.
FINISH_CANCELLED: Final = "cancelled"
FINISH_REASONS: Final = (FINISH_EOS, FINISH_LENGTH, FINISH_STOP_STRING, FINISH_TIME, FINISH_STOPPING_CRITERION)
# What a client shows for the wire's zero value (a reason it does not know).
FINISH_UNSPECIFIED: Final = "unspecified"


class FinishReason(enum.IntEnum):
    """Why a row stopped, as the integer code stopping criteria put in tensors; `NONE` while it runs.

    The numbers are those of the wire's `specwire.common.v1.FinishReason` (0 is its `UNSPECIFIED`).
    """

    NONE = 0
    LENGTH = 1
    EOS = 2
    STOP_STRING = 3
    TIME = 4
    # 5 is the wire's CANCELLED, which no criterion reports.
    STOPPING_CRITERION = 6


# Code -> name, for the codes that mean a finished row.
FINISH_REASON_NAMES: Final[Mapping[int, str]] = MappingProxyType(
    {
        FinishReason.LENGTH: FINISH_LENGTH,
        FinishReason.EOS: FINISH_EOS,
        FinishReason.STOP_STRING: FINISH_STOP_STRING,
        FinishReason.TIME: FINISH_TIME,
        FinishReason.STOPPING_CRITERION: FINISH_STOPPING_CRITERION,
    }
)

# ---------------------------------------------------------------------------------------------------
# Load balancing: the gRPC policies a client channel may use (`load_balancing=`, `--load-balancing`).
# `round_robin` sends each call to the next ready address; `pick_first` every call to the first
# address that connects (the others are fallbacks).
# ---------------------------------------------------------------------------------------------------

ROUND_ROBIN: Final = "round_robin"
PICK_FIRST: Final = "pick_first"
LOAD_BALANCING_POLICIES: Final = (ROUND_ROBIN, PICK_FIRST)

# ---------------------------------------------------------------------------------------------------
# Metrics: what the target service exports (`specwire.target_service.observability`) and
# `specwire stats` reads back from a Prometheus scrape (`specwire.client.stats`).
# ---------------------------------------------------------------------------------------------------

# Speculative-decoding counters. Prometheus shows them under the same names.
METRIC_DRAFTS: Final = "specwire_spec_decode_drafts_total"
METRIC_DRAFT_TOKENS: Final = "specwire_spec_decode_draft_tokens_total"
METRIC_ACCEPTED_TOKENS: Final = "specwire_spec_decode_accepted_tokens_total"
METRIC_ACCEPTED_PER_POSITION: Final = "specwire_spec_decode_accepted_tokens_per_position_total"
# Request-latency histograms (GenAI semantic conventions). Prometheus shows them with `.` -> `_` and
# a `_seconds` suffix (`gen_ai_server_request_duration_seconds`).
METRIC_REQUEST_DURATION: Final = "gen_ai.server.request.duration"
METRIC_TIME_TO_FIRST_TOKEN: Final = "gen_ai.server.time_to_first_token"
METRIC_TIME_PER_OUTPUT_TOKEN: Final = "gen_ai.server.time_per_output_token"
# The target's load, the signals to autoscale on (gauges, read at each scrape; labelled by model).
# Requests waiting for KV slots: the clearest "add a replica" signal (a queue means every slot is taken).
METRIC_REQUESTS_QUEUED: Final = "specwire_target_requests_queued"
# Requests generating now.
METRIC_REQUESTS_RUNNING: Final = "specwire_target_requests_running"
# KV-cache slots (one per running row) taken, and in all; their ratio, 0 to 1 (absent without a slot
# cache, i.e. with sequential scheduling).
METRIC_KV_SLOTS_USED: Final = "specwire_target_kv_slots_used"
METRIC_KV_SLOTS: Final = "specwire_target_kv_slots"
METRIC_KV_SLOT_USAGE: Final = "specwire_target_kv_slot_usage"

# Labels (attributes) of those metrics.
LABEL_MODEL: Final = "model"
LABEL_PROPOSER: Final = "proposer"
LABEL_CONFIG: Final = "config"
LABEL_POSITION: Final = "position"  # 0-based draft position, on METRIC_ACCEPTED_PER_POSITION only
