"""Stopping criteria: hand-built cases, finish reasons, and parity with transformers' criteria."""

from __future__ import annotations

import random
import time
import types

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.generation import stopping_criteria as hf

from specwire.generation.loops.stop_codes import StopCodes
from specwire.generation.stopping import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    _bytes_to_unicode,
    build_stopping_criteria,
)
from specwire.vocabulary import FinishReason
from tests.tiny_models import build_tokenizer

# transformers' own stop-string examples (tests/generation/test_stopping_criteria.py).
STOP_STRINGS = ["<|im_end|>", "stop", "e nd"]
TRUE_STRINGS = [
    "<|im_start|><|im_end|>",
    "<|im_start|><|im_end|<|im_end|>",
    ">><|im_start|>>stop",
    "stop",
    "e nd",
]
FALSE_STRINGS = [
    "<|im_start|><|im_end|",
    "<|im_start|><|im_end|<|im_end|",
    "<|im_end|><|im_start|>",
    "<|im_end|<>stop<|im_end|",
    "end",
    "en d",
    "eNd",
    "<|im_end|",
    "|im_end|>",
    "s",
]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny byte-level BPE tokenizer of the test models (a ByteLevel decoder: byte mode)."""
    return build_tokenizer()


def _explicit_tokenizer(tokens: list[str], *, byte_level: bool) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is the single characters plus exactly `tokens` (no merges needed)."""
    if byte_level:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {ch: i for i, ch in enumerate(alphabet)}
        for tok in tokens:
            vocab.setdefault(tok, len(vocab))
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        chars = sorted(set("abcdefghijklmnopqrstuvwxyz▁" + "".join(tokens)))
        vocab = {"<unk>": 0, **{ch: i + 1 for i, ch in enumerate(chars)}}
        for tok in tokens:
            vocab.setdefault(tok, len(vocab))
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _ids(tok, pieces: list[str]) -> torch.Tensor:
    return torch.tensor([tok.convert_tokens_to_ids(pieces)])


# ------------------------------------------------------------------------------------------ simple criteria


def test_max_length_criteria():
    crit = MaxLengthCriteria(5)
    assert crit(torch.zeros(3, 4, dtype=torch.long)).tolist() == [False] * 3
    assert crit(torch.zeros(3, 5, dtype=torch.long)).tolist() == [True] * 3
    with pytest.raises(ValueError, match="non-negative integer"):
        MaxLengthCriteria(-1)


def test_max_time_criteria():
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert MaxTimeCriteria(10.0)(ids).tolist() == [False, False]
    assert MaxTimeCriteria(0.1, initial_timestamp=time.time() - 0.2)(ids).tolist() == [True, True]
    with pytest.raises(ValueError, match="seconds"):
        MaxTimeCriteria("soon")


def test_eos_criteria_and_new_token_length():
    crit = EosTokenCriteria([2, 7])
    ids = torch.tensor([[1, 2, 5], [1, 5, 7], [2, 5, 5]])
    assert crit(ids).tolist() == [False, True, False]
    # After a block of 2 accepted tokens, an EOS inside the block counts too.
    assert crit(ids, new_token_length=2).tolist() == [True, True, False]
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 6, (8, 6), generator=g)
        for n in (1, 3):
            assert torch.equal(
                crit(ids, None, new_token_length=n),
                hf.EosTokenCriteria([2, 7])(ids, None, new_token_length=n),
            )
    with pytest.raises(ValueError, match="non-negative integer"):
        EosTokenCriteria([-1])


def test_confidence_criteria_per_row_and_row0_matches_transformers():
    ids = torch.tensor([[1, 0], [1, 3]])
    scores = torch.full((2, 4), -10.0)
    scores[0, 0] = 10.0  # row 0 confident in its last token, row 1 not
    crit = ConfidenceCriteria(0.5)
    assert crit(ids, (scores,)).tolist() == [False, True]
    assert crit(ids, scores).tolist() == [False, True]
    ref = hf.ConfidenceCriteria(0.5)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(1, 6, generator=g) * 3
        one = torch.randint(0, 6, (1, 4), generator=g)
        assert bool(crit(one, (s,))[0]) == ref(one, (s,))
    with pytest.raises(ValueError, match="probability"):
        ConfidenceCriteria(1.5)


def test_finish_reasons_first_criterion_in_list_order_wins():
    crits = StoppingCriteriaList([MaxLengthCriteria(4), EosTokenCriteria(2)])
    running = torch.tensor([[1, 5, 6], [1, 5, 2]])
    assert crits(running).tolist() == [False, True]
    assert crits.finish_reasons(running).tolist() == [FinishReason.NONE, FinishReason.EOS]
    at_max = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 2]])
    # Both criteria fire on row 1; MaxLength comes first in the list.
    assert crits.finish_reasons(at_max).tolist() == [FinishReason.LENGTH, FinishReason.LENGTH]
    swapped = StoppingCriteriaList([EosTokenCriteria(2), MaxLengthCriteria(4)])
    assert swapped.finish_reasons(at_max).tolist() == [FinishReason.LENGTH, FinishReason.EOS]
    # ConfidenceCriteria stops a draft block but never names a finish reason.
    with_conf = StoppingCriteriaList([ConfidenceCriteria(0.99), EosTokenCriteria(2)])
    scores = torch.zeros(2, 8)
    assert with_conf(running, scores).tolist() == [True, True]
    assert with_conf.finish_reasons(running, scores).tolist() == [FinishReason.NONE, FinishReason.EOS]
    assert crits.max_length == 4 and swapped.max_length == 4 and StoppingCriteriaList().max_length is None
    assert [int(r) for r in FinishReason] == [0, 1, 2, 3, 4, 6]  # 5 is the wire's CANCELLED


@pytest.mark.parametrize("eos_first", [False, True])
def test_stop_codes_by_last_token_equal_the_criteria_tensors(eos_first):
    """`StopCodes`' Python path (a length limit and EOS ids) gives the codes of `finish_reasons` + the EOS rule."""
    criteria = [MaxLengthCriteria(7), EosTokenCriteria([2, 7])]
    stop = StopCodes(StoppingCriteriaList(criteria[::-1] if eos_first else criteria), [2, 7], torch.device("cpu"))
    tensors = StopCodes(StoppingCriteriaList([*stop.criteria, MaxTimeCriteria(1e9)]), [2, 7], torch.device("cpu"))
    assert stop.by_last_token and not tensors.by_last_token
    seen = set()
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        for length in (1, 5, 6, 7, 9):
            ids = torch.randint(0, 9, (6, length), generator=g)
            codes = stop(ids, None)
            assert codes.dtype == torch.long and torch.equal(codes, tensors(ids, None))
            assert [stop.code(length, t) for t in ids[:, -1].tolist()] == codes.tolist()
            seen.update(codes.tolist())
    assert seen == {FinishReason.NONE, FinishReason.LENGTH, FinishReason.EOS}  # every branch was met
    no_eos = StopCodes(StoppingCriteriaList([MaxLengthCriteria(3)]), None, torch.device("cpu"))
    assert no_eos(torch.tensor([[1, 2, 2], [1, 2, 3]]), None).tolist() == [FinishReason.LENGTH] * 2
    assert no_eos(torch.tensor([[1, 2]]), None).tolist() == [FinishReason.NONE]


def test_stop_codes_past_the_context_warn_once_on_either_path(caplog):
    for criteria in (
        [MaxLengthCriteria(10, max_position_embeddings=3)],
        [MaxLengthCriteria(10, 3), MaxTimeCriteria(1e9)],
    ):
        stop = StopCodes(StoppingCriteriaList(criteria), None, torch.device("cpu"))
        caplog.clear()
        for length in (3, 4, 5):
            stop(torch.zeros((2, length), dtype=torch.long), None)
        assert sum("maximum length" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------------------------------ the factory


def test_build_stopping_criteria_order_and_conditions(tokenizer):
    config = types.SimpleNamespace(max_time=5.0, stop_strings=["stop"], assistant_confidence_threshold=0.4)
    crits = build_stopping_criteria(
        config, max_length=30, eos_token_ids=[2], tokenizer=tokenizer, max_position_embeddings=256
    )
    assert [type(c).__name__ for c in crits] == [
        "MaxLengthCriteria",
        "MaxTimeCriteria",
        "StopStringCriteria",
        "EosTokenCriteria",
    ]
    assert crits.max_length == 30
    draft = build_stopping_criteria(config, max_length=30, eos_token_ids=2, tokenizer=tokenizer, is_assistant=True)
    assert type(draft[-1]).__name__ == "ConfidenceCriteria"
    bare = build_stopping_criteria(types.SimpleNamespace(), max_length=None, eos_token_ids=None)
    assert len(bare) == 0
    assert [
        type(c).__name__ for c in build_stopping_criteria(types.SimpleNamespace(), max_length=8, eos_token_ids=[])
    ] == ["MaxLengthCriteria"]
    with pytest.raises(ValueError, match="pass the model's tokenizer"):
        build_stopping_criteria(types.SimpleNamespace(stop_strings="x"), max_length=8, eos_token_ids=2)


def test_build_stopping_criteria_matches_transformers_order(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for fields in (
        {},
        {"max_time": 3.0},
        {"stop_strings": ["fox"], "max_time": 1.0},
        {"stop_strings": "e nd"},
    ):
        gc = GenerationConfig(max_length=30, eos_token_id=2, **fields)
        model._prepare_special_tokens(gc, device="cpu")
        theirs = model._get_stopping_criteria(gc, stopping_criteria=hf.StoppingCriteriaList(), tokenizer=tokenizer)
        ours = build_stopping_criteria(
            types.SimpleNamespace(**fields),
            max_length=30,
            eos_token_ids=[2],
            tokenizer=tokenizer,
            max_position_embeddings=256,
        )
        assert [type(c).__name__ for c in ours] == [type(c).__name__ for c in theirs]


# ------------------------------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("byte_level", [True, False], ids=["byte-mode", "string-mode"])
def test_stop_string_hand_built_token_splits(byte_level):
    tok = _explicit_tokenizer(
        ["st", "op", "las", "topper", "s", "to", "pped", "stop", "at", "xstopx"], byte_level=byte_level
    )
    crit = StopStringCriteria(tok, ["stop"])
    assert crit._vocab.mode == ("byte_level" if byte_level else None)
    cases = {
        ("st", "op"): True,  # split across two tokens
        ("las", "topper"): True,  # starts inside an earlier token, overhangs past the last one
        ("s", "to", "pped"): True,
        ("stop",): True,
        ("xstopx",): True,  # entirely inside the last token
        ("stop", "at"): False,  # ended before the final token
        ("st", "at"): False,
        ("op",): False,
    }
    for pieces, expected in cases.items():
        ids = _ids(tok, list(pieces))
        assert crit(ids).tolist() == [expected], pieces
        assert hf.StopStringCriteria(tok, ["stop"])(ids, None).tolist() == [expected], pieces


def test_stop_string_transformers_examples(tokenizer):
    tokenizer.padding_side = "left"
    crit = StopStringCriteria(tokenizer, STOP_STRINGS)
    ref = hf.StopStringCriteria(tokenizer, STOP_STRINGS)
    true_ids = tokenizer(TRUE_STRINGS, return_tensors="pt", padding="longest", add_special_tokens=False)["input_ids"]
    false_ids = tokenizer(FALSE_STRINGS, return_tensors="pt", padding="longest", add_special_tokens=False)["input_ids"]
    assert crit(true_ids).tolist() == [True] * len(TRUE_STRINGS)
    assert crit(false_ids).tolist() == [False] * len(FALSE_STRINGS)
    assert torch.equal(crit(true_ids), ref(true_ids, None))
    assert torch.equal(crit(false_ids), ref(false_ids, None))
    # A single string argument is one stop string.
    assert StopStringCriteria(tokenizer, "stop")(true_ids[3:4]).tolist() == [True]


def test_stop_string_byte_mode_split_multibyte_character(tokenizer):
    """'é' is two UTF-8 bytes; with each byte its own token the stop string still matches (5.x byte mode)."""
    table = _bytes_to_unicode()  # byte -> the character a ByteLevel vocabulary spells it with
    first, second = table[0xC3], table[0xA9]
    caf = tokenizer.convert_tokens_to_ids([table[ord(c)] for c in "caf"])
    ids = torch.tensor([caf + tokenizer.convert_tokens_to_ids([first, second])])
    crit = StopStringCriteria(tokenizer, ["é"])
    assert crit._vocab.mode == "byte_level"
    assert crit(ids).tolist() == [True]
    assert crit(ids[:, :-1]).tolist() == [False]  # only the first byte so far
    assert StopStringCriteria(tokenizer, ["fé"])(ids).tolist() == [True]
    assert StopStringCriteria(tokenizer, ["afé"])(ids).tolist() == [True]
    assert StopStringCriteria(tokenizer, ["bé"])(ids).tolist() == [False]
    assert torch.equal(crit(ids), hf.StopStringCriteria(tokenizer, ["é"])(ids, None))
    # A stop string must end within the final token: a text ending in its prefix is no match.
    assert StopStringCriteria(tokenizer, ["é!"])(ids).tolist() == [False]
    assert hf.StopStringCriteria(tokenizer, ["é!"])(ids, None).tolist() == [False]


STOP_SETS = [
    ["stop"],
    ["st", "op"],
    ["fox", "capital of"],
    ["é", "aé"],
    ["\n    "],
    ["Paris is the capital of France."],
    ["e nd", "<|im_end|>", "is"],
    ["</s>"],
]


def _random_token_split(tokenizer, text: str, rng: random.Random) -> list[int]:
    """Token ids spelling `text` with random token boundaries, some in the middle of a UTF-8 character."""
    table = _bytes_to_unicode()
    data = text.encode("utf-8")
    ids, pos = [], 0
    while pos < len(data):
        step = rng.randint(1, 4)
        chunk = "".join(table[b] for b in data[pos : pos + step])
        token_id = tokenizer.convert_tokens_to_ids(chunk)
        if token_id == tokenizer.unk_token_id or token_id is None:
            ids.extend(tokenizer.convert_tokens_to_ids(list(chunk)))  # every single byte is a token
        else:
            ids.append(token_id)
        pos += step
    return ids


@pytest.mark.parametrize("stops", STOP_SETS, ids=[repr(s) for s in STOP_SETS])
def test_stop_string_matches_transformers_on_random_sequences(tokenizer, stops):
    crit = StopStringCriteria(tokenizer, stops)
    ref = hf.StopStringCriteria(tokenizer, stops)
    rng = random.Random(sum(map(ord, "".join(stops))))
    noise = ["", "a", "x ", "é", "st", "The ", "</s>", "\n"]
    vocab_size = len(tokenizer)
    outcomes = []
    for _ in range(40):
        rows = []
        for _ in range(rng.randint(1, 4)):
            suffix = "" if rng.random() < 0.5 else rng.choice(noise)
            text = rng.choice(noise) + rng.choice(stops) + suffix
            ids = _random_token_split(tokenizer, text, rng)
            # Cut anywhere (before, inside or after the stop string) and sprinkle in unknown ids.
            if rng.random() < 0.5:
                ids = ids[: rng.randint(1, len(ids))]
            if rng.random() < 0.2:
                ids.insert(rng.randrange(len(ids)), rng.randrange(vocab_size, vocab_size + 5))
            rows.append(ids)
        width = max(len(r) for r in rows)
        batch = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left-padded with <pad>
        ours = crit(batch)
        assert torch.equal(ours, ref(batch, None)), (stops, batch.tolist())
        outcomes.extend(ours.tolist())
    # The comparison must have covered both outcomes many times.
    assert outcomes.count(True) >= 10 and outcomes.count(False) >= 10, outcomes
    for s in stops:
        encoded = torch.tensor([tokenizer(s, add_special_tokens=False)["input_ids"]])
        assert crit(encoded).tolist() == [True]


def test_byte_table_matches_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _bytes_to_unicode() == bytes_to_unicode()


def test_stop_string_clean_vocab_is_cached_per_tokenizer(tokenizer):
    a = StopStringCriteria(tokenizer, ["stop"])
    b = StopStringCriteria(tokenizer, ["fox"])
    assert a._vocab is b._vocab


def test_stop_string_errors(tokenizer):
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StopStringCriteria(tokenizer, [])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StopStringCriteria(tokenizer, [3])
    tok = _explicit_tokenizer(["ab"], byte_level=False)
    with pytest.raises(ValueError, match="can't produce"):
        StopStringCriteria(tok, ["中"])
    with pytest.raises(ValueError):
        hf.StopStringCriteria(tok, ["中"])


def test_empty_stop_string_matches_every_row_like_transformers(tokenizer):
    ids = torch.tensor([[5, 6], [7, 8]])
    assert StopStringCriteria(tokenizer, [""])(ids).tolist() == [True, True]
    assert hf.StopStringCriteria(tokenizer, ["", "x"])(ids, None).tolist() == [True, True]
    assert StopStringCriteria(tokenizer, ["", "x"])(ids).tolist() == [True, True]


# ------------------------------------------------------------------------------------------ hardening


def _char_tokenizer_without_decoder() -> PreTrainedTokenizerFast:
    """One token per printable character and no decoder (96 tokens): `decode` joins tokens with spaces."""
    import string

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_stop_strings_work_with_a_tokenizer_whose_decoder_rewrites_the_prefix():
    """transformers' clean-vocabulary step looks for "abcdef" in the decoded prefix and raises
    "substring not found" when the decoder doesn't give it back verbatim (here: tokens joined by spaces)."""
    tok = _char_tokenizer_without_decoder()
    with pytest.raises(ValueError, match="substring not found"):
        hf.StopStringCriteria(tok, ["b"])
    ids = torch.tensor([tok("xab", add_special_tokens=False)["input_ids"]])
    assert tok.decode(ids[0]) == "x a b"  # the text stop strings are matched against
    assert StopStringCriteria(tok, [" b"])(ids).tolist() == [True]
    assert StopStringCriteria(tok, ["a b"])(ids).tolist() == [True]
    assert StopStringCriteria(tok, ["ab", " z"])(ids).tolist() == [False]  # "ab" never appears in the text
    with pytest.raises(ValueError, match="can.t produce"):
        StopStringCriteria(tok, ["ab"])  # no token can end it: the text has a space between any two tokens
    assert StopStringCriteria(tok, ["x a"])(ids).tolist() == [False]  # ended before the last token
    assert StopStringCriteria(tok, [f"s{i}x" for i in range(1000)] + ["a b"])(ids).tolist() == [True]


def test_reachability_agrees_with_the_definition(tokenizer):
    """`_can_end` (tokens indexed by first character) against a scan of every token with `_end_overlaps`."""
    from specwire.generation.stopping import _end_overlaps

    for tok in (tokenizer, _explicit_tokenizer(["ab", "b▁c"], byte_level=False), _char_tokenizer_without_decoder()):
        crit = StopStringCriteria(tok, ["a"])
        tokens = [t for t in crit._vocab.clean if t]
        rng = random.Random(3)
        alphabet = "ab c▁xé中\n"
        for _ in range(150):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            target = s.encode() if crit._vocab.mode is not None else s
            want = any(_end_overlaps(t, target) for t in tokens)
            assert crit._can_end(target) == want, (tok, s)


def test_reachable_stop_string_cache_is_a_bounded_lru(tokenizer, monkeypatch):
    from specwire.generation import stopping

    monkeypatch.setattr(stopping, "REACHABLE_CACHE_SIZE", 3)
    vocab = StopStringCriteria(tokenizer, ["fox"])._vocab
    vocab.reachable.clear()
    for word in ["quick", "brown", "lazy", "dog"]:
        StopStringCriteria(tokenizer, [word])
    assert list(vocab.reachable) == [b"brown", b"lazy", b"dog"]  # "quick" was the least recently used
    StopStringCriteria(tokenizer, ["brown"])  # a hit moves it to the end
    StopStringCriteria(tokenizer, ["Paris"])
    assert list(vocab.reachable) == [b"dog", b"brown", b"Paris"]
    # Many distinct stop strings, one request each: the cache stays at its bound.
    for i in range(50):
        StopStringCriteria(tokenizer, [f"w{i}"])
    assert len(vocab.reachable) == 3


def test_unreachable_stop_strings_are_invalid_argument():
    from specwire.errors import InvalidArgument

    tok = _explicit_tokenizer(["ab"], byte_level=False)
    with pytest.raises(InvalidArgument) as caught:
        StopStringCriteria(tok, ["中", "日"])
    assert [v.field for v in caught.value.violations] == ["stop_strings"]
    # One endable string is enough, as in transformers.
    assert StopStringCriteria(tok, ["中", "ab"])(torch.tensor([[tok.convert_tokens_to_ids("ab")]])).tolist() == [True]
