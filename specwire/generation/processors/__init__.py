"""Logits processors (pure torch): one module per family, and the factory ordering them like transformers."""

from .base import LogitsProcessor, LogitsProcessorList
from .bias import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor
from .factory import build_logits_processors
from .guidance import UnbatchedClassifierFreeGuidanceLogitsProcessor
from .length import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)
from .numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from .penalties import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    ExponentialDecayLengthPenalty,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from .suppress import SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor
from .warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from .watermark import WatermarkLogitsProcessor

__all__ = [
    "EncoderNoRepeatNGramLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "ExponentialDecayLengthPenalty",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "LogitsProcessor",
    "LogitsProcessorList",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "MinPLogitsWarper",
    "NoBadWordsLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "TemperatureLogitsWarper",
    "TopHLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TypicalLogitsWarper",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "WatermarkLogitsProcessor",
    "build_logits_processors",
]
