"""A draft model's lean forward (`specwire.runtime.lean_draft`): bitwise the model's own forward over a
`DynamicCache` (float32 and int8 drafts), so drafts, their probabilities and hindsight are the same with it and
without; declined for sliding-window attention and for a model whose forward is wrapped or hooked."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.config import GenerationConfig
from specwire.generation.speculation.drafters import ModelDrafter
from specwire.models import quantize_int8
from specwire.runtime import lean_draft
from specwire.runtime.lean_draft import draft_decoder, lean_draft_forward, lean_logits
from tests.unit.test_lean_decoder import _random

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]


@pytest.fixture(scope="module")
def int8_draft(tiny_draft):
    return quantize_int8(tiny_draft, progress=False)


@pytest.mark.parametrize("which", ["float32", "int8"])
def test_lean_logits_are_the_models_over_a_prompt_decode_steps_and_blocks(tiny_draft, int8_draft, which):
    from transformers import DynamicCache

    model = (tiny_draft if which == "float32" else int8_draft).model
    decoder = draft_decoder(model)
    assert decoder is not None
    config = model.config.get_text_config(decoder=True)
    want_cache, got_cache = DynamicCache(config=config), DynamicCache(config=config)
    past = 0
    with torch.inference_mode():
        for ids in (PROMPT, [11], [12, 13, 14, 15], [16]):
            want = model(input_ids=torch.tensor([ids]), past_key_values=want_cache, use_cache=True).logits
            got = lean_logits(decoder, ids, got_cache, past, len(ids), torch.device("cpu"))
            assert torch.equal(want, got)
            past += len(ids)
        want_cache.crop(-3)  # a rejected block's rollback, then on
        got_cache.crop(-3)
        want = model(input_ids=torch.tensor([[17, 18]]), past_key_values=want_cache, use_cache=True).logits
        assert torch.equal(want, lean_logits(decoder, [17, 18], got_cache, past - 3, 2, torch.device("cpu")))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_drafter_proposes_the_same_with_the_lean_forward_and_without(int8_draft, do_sample):
    model = int8_draft.model
    config = GenerationConfig(eos_token_id=2, do_sample=do_sample, assistant_confidence_threshold=0.0)

    def run(forward) -> list:
        drafter = ModelDrafter(
            model, [list(PROMPT)], config, 378, return_probs=True, generator=torch.Generator(), forward=forward
        )
        drafter.generator.manual_seed(0)
        out = []
        for accepted in (2, 0, 4):
            proposal = drafter.propose(4)
            out.append((proposal.tokens, [p.tolist() for p in proposal.probs], proposal.hindsight))
            tokens = proposal.tokens[0]
            drafter.feedback([accepted], [[(tokens[accepted] + 1) % 378 if accepted < len(tokens) else 9]], [False])
        for token in (20, 21, 22):  # time off: a look-back's hindsight
            drafter.feedback([0], [[token]], [False])
        out.append(drafter.propose(0).hindsight)
        return out

    assert draft_decoder(model) is not None
    assert run(lean_draft_forward) == run(None)
    hook = model.register_forward_pre_hook(lambda *_: None)  # instrumented: the model's own forward runs
    try:
        assert lean_draft_forward(model, None, [5], 0, 1, torch.device("cpu")) is None
    finally:
        hook.remove()


def test_declined_for_sliding_window_attention_and_for_a_wrapped_forward(tiny_draft, monkeypatch):
    assert draft_decoder(_random("MistralConfig", "MistralForCausalLM", sliding_window=16)) is None
    model = tiny_draft.model
    monkeypatch.setattr(model, "forward", model.forward)  # a wrapper on the instance
    assert draft_decoder(model) is None


def test_a_decoder_whose_logits_differ_is_not_used(tiny_model_dir, monkeypatch):
    from specwire.models import load_model

    model = load_model(str(tiny_model_dir), progress=False).model
    monkeypatch.setattr(lean_draft, "_same_logits", lambda *_: False)
    assert draft_decoder(model) is None


def test_the_services_check_a_draft_before_their_first_request(tiny_model_dir, tiny_draft_dir):
    """The check runs forwards (~150 ms for SmolLM2's int8 draft): made at start, so no request's catch-up times it
    (the speculation controller's catch-up line kept such a one-off for good). The target's co-located draft is
    checked on the starting thread without an OpenMP pool, the draft service's on its model thread."""
    from specwire.draft_service.service import DraftServicer
    from specwire.models import load_model
    from specwire.target_service.__main__ import build_parser, load_draft_model

    target = load_model(str(tiny_model_dir), progress=False)
    colocated = load_draft_model(build_parser().parse_args(["--draft-model", str(tiny_draft_dir)]), target)
    assert lean_draft._decoders[colocated.model] is not None

    remote = load_model(str(tiny_draft_dir), progress=False)
    servicer = DraftServicer(draft_model=remote)
    try:
        servicer.executor.submit(lambda: None).result(timeout=60)  # after the check queued at construction
        assert lean_draft._decoders[remote.model] is not None
    finally:
        servicer.executor.shutdown()
