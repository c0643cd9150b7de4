"""`LeanDecoder` gives bitwise the logits (and KV cache) of the model's own packed forward, with its small
blocks off; with them on, a block's float32 CPU projections are bitwise its rows' one-row products."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from specwire.models import load_model
from specwire.runtime import lean_decoder
from specwire.runtime.lean_decoder import LeanDecoder, SmallBlocks, _activation, _Head, _rotate, _signed_sin
from specwire.runtime.slot_cache import SlotKVCache, install_slot_attention, run_packed

# Packed steps as (pieces, keep): (slot, cursor, tokens) per row piece.
STEPS = [
    # Two prompts, the second one chunked: its first 5 tokens now, the rest with the next step.
    ([(0, 0, [5, 6, 7, 8, 9, 10, 11]), (1, 0, [20, 21, 22, 23, 24])], [6, 11]),
    # A decode row, a verify block of 3 and the rest of a prefill in one forward.
    ([(0, 7, [12]), (1, 5, [25, 26]), (2, 0, [30, 31, 32, 33])], [0, 1, 2, 6]),
    # Two rows with equal cursors and adjacent slots: attended as one group.
    ([(0, 8, [13]), (1, 7, [27]), (2, 4, [34])], [0, 1, 2]),
]


def _run_steps(model, decoder):
    cache = SlotKVCache(model, 3, 32)
    with torch.inference_mode():
        logits = [run_packed(model, cache, pieces, keep, decoder) for pieces, keep in STEPS]
    return logits, cache


def _small_blocks_off():
    small_blocks = SmallBlocks()
    small_blocks.enabled = False
    return small_blocks


def _model_products(decoder):
    """`decoder`, computing every product as `model(...)` does."""
    decoder.small_blocks.enabled = False
    return decoder


def _assert_same_as_model(model):
    install_slot_attention(model)
    assert LeanDecoder.unsupported(model) == ""
    want, want_cache = _run_steps(model, None)
    got, got_cache = _run_steps(model, _model_products(LeanDecoder(model)))
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b), (a - b).abs().max()
    lengths = [9, 8, 5]  # positions each slot holds after STEPS
    for layer in range(want_cache.num_layers):
        for slot, n in enumerate(lengths):
            assert torch.equal(want_cache.keys[layer][slot, :, :n], got_cache.keys[layer][slot, :, :n])
            assert torch.equal(want_cache.values[layer][slot, :, :n], got_cache.values[layer][slot, :, :n])


def test_lean_forward_is_bitwise_the_model_forward_on_a_saved_llama(tiny_model_dir):
    _assert_same_as_model(load_model(str(tiny_model_dir), progress=False).model)


def _random(config_class_name, model_class_name, **extra):
    import transformers

    settings = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    config = getattr(transformers, config_class_name)(**{**settings, **extra})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_class_name)(config).eval()


def test_lean_forward_uses_projection_biases_and_rope_scaling():
    # Qwen2 has q/k/v biases; llama3 RoPE scaling goes through the model's own rotary module.
    qwen = _random("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=False)
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    _assert_same_as_model(qwen)
    scaled = _random(
        "LlamaConfig",
        "LlamaForCausalLM",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    _assert_same_as_model(scaled)


def test_lean_forward_in_bfloat16_and_with_another_activation_is_bitwise_the_model_forward():
    # bfloat16 takes RMSNorm's float32 round trip (skipped on float32); GELU is called as the model's module.
    _assert_same_as_model(_random("LlamaConfig", "LlamaForCausalLM").to(torch.bfloat16))
    gelu = _random("LlamaConfig", "LlamaForCausalLM", hidden_act="gelu")
    assert LeanDecoder(gelu).layers[0].act is gelu.model.layers[0].mlp.act_fn
    _assert_same_as_model(gelu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rolled_rotation_is_bitwise_transformers_rotation(dtype):
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(0)
    x = torch.randn(1, 4, 7, 64).to(dtype)
    x[0, 0, 0, :8] = 0.0  # signed zeros
    x[0, 1, 0, 40:48] = -0.0
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # a transposed view, as the decoder passes
    angles = torch.randn(1, 1, 7, 64)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want = (x * cos) + (rotate_half(x) * sin)
    got = _rotate(x, cos, _signed_sin(sin))
    assert torch.equal(got, want)
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )  # zero signs too


def test_silu_modules_are_called_as_f_silu():
    from transformers.activations import SiLUActivation

    assert _activation(SiLUActivation()) is F.silu
    assert _activation(torch.nn.SiLU()) is F.silu
    inplace = torch.nn.SiLU(inplace=True)
    assert _activation(inplace) is inplace


def test_lean_forward_with_a_chunked_head_is_bitwise_the_model_forward():
    # A vocabulary over one head chunk, and a verify block of 11 kept positions (prompt lookup's 10 + 1).
    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500)
    install_slot_attention(model)
    steps = [([(0, 0, list(range(3, 12)))], [8]), ([(0, 9, list(range(40, 51)))], list(range(11)))]
    cache, lean_cache = SlotKVCache(model, 1, 32), SlotKVCache(model, 1, 32)
    decoder = _model_products(LeanDecoder(model))
    with torch.inference_mode():
        for pieces, keep in steps:
            want = run_packed(model, cache, pieces, keep)
            assert torch.equal(want, run_packed(model, lean_cache, pieces, keep, decoder))


@pytest.mark.parametrize(("hidden", "vocab", "bias"), [(32, 1500, False), (576, 4100, True), (64, 3000, True)])
def test_the_head_is_bitwise_the_plain_product_for_every_row_count(hidden, vocab, bias):
    # `_Head` chunks only the row counts where chunks gave bitwise one product the first time it saw them; on
    # this machine's MKL (576, 4100) is a shape where they do not, so a head that chunked without checking fails
    # here. Each row count runs three times: its check, then the product it settled on.
    torch.manual_seed(0)
    linear = torch.nn.Linear(hidden, vocab, bias=bias)
    head = _Head(linear, _small_blocks_off())
    with torch.no_grad():
        for rows in range(1, 36):
            for _ in range(3):
                hidden_states = torch.randn(1, rows, hidden)
                assert torch.equal(head(hidden_states), F.linear(hidden_states, linear.weight, linear.bias)), rows
    assert set(head.chunked_rows) == set(range(2, 34))


def test_a_chunked_head_computes_the_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 2500)
    head = _Head(linear, _small_blocks_off())
    assert len(head.chunks) == 3 and head.may_chunk
    with torch.no_grad():
        hidden_states = torch.randn(1, 11, 32)
        head(hidden_states)  # the check of 11 rows
        head.chunked_rows[11] = True  # whatever it found: the chunked product from now on
        got = head(hidden_states)
        assert got.shape == (1, 11, 2500)
        assert torch.allclose(got, F.linear(hidden_states, linear.weight, linear.bias), atol=1e-6)


def _one_row_products(hidden_states, linear):
    rows = [F.linear(hidden_states[:, i : i + 1], linear.weight, linear.bias) for i in range(hidden_states.shape[1])]
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize(("features", "bias"), [((576, 576), False), ((576, 1536), False), ((576, 4100), True)])
def test_small_blocks_are_the_one_row_products_where_checked_else_the_plain_product(features, bias):
    # Whether `weight @ block^T` holds is this machine's MKL's business; what the projection returns is then
    # bitwise either the rows' one-row products (checked) or `F.linear` (declined), never anything else.
    torch.manual_seed(0)
    linear = torch.nn.Linear(*features, bias=bias)
    small_blocks = SmallBlocks()
    project = lean_decoder._projection(linear, small_blocks)
    with torch.no_grad():
        for rows in range(1, 7):
            for _ in range(2):  # the check, then the product it settled on
                hidden_states = torch.randn(1, rows, features[0])
                got = project(hidden_states)
                exact = small_blocks.exact.get((features[1], features[0], rows))
                want = _one_row_products if exact else lambda h, lin: F.linear(h, lin.weight, lin.bias)
                assert torch.equal(got, want(hidden_states, linear)), rows
    assert sorted(key[2] for key in small_blocks.exact) == [2, 3, 4]


def test_a_small_block_that_fails_its_check_is_not_used(monkeypatch):
    products = []

    def off_by_a_bit(hidden, weight, bias):
        products.append(hidden.shape)
        return F.linear(hidden, weight, bias) + 1e-3

    monkeypatch.setattr(lean_decoder, "_small_block_product", off_by_a_bit)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    small_blocks = SmallBlocks()
    project = lean_decoder._projection(linear, small_blocks)
    with torch.no_grad():
        for _ in range(3):
            hidden_states = torch.randn(1, 3, 64)
            assert torch.equal(project(hidden_states), F.linear(hidden_states, linear.weight, linear.bias))
    assert small_blocks.exact == {(96, 64, 3): False}
    assert len(products) == 1  # checked once, then declined without computing it


def test_small_blocks_leave_other_dtypes_and_a_disabled_decoder_alone():
    torch.manual_seed(0)
    small_blocks = SmallBlocks()
    half = lean_decoder._projection(torch.nn.Linear(64, 96).to(torch.bfloat16), small_blocks)
    with torch.no_grad():
        half(torch.randn(1, 3, 64).to(torch.bfloat16))
        assert small_blocks.exact == {}
        small_blocks.enabled = False
        assert small_blocks.product(torch.randn(1, 3, 64), torch.randn(96, 64), None) is None


def test_a_decoder_with_small_blocks_runs_blocks_through_them_and_keeps_the_model_logits_closely():
    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500)
    install_slot_attention(model)
    decoder = LeanDecoder(model)
    want, _ = _run_steps(model, None)
    got, _ = _run_steps(model, decoder)
    # STEPS packs 12, 7 and 3 tokens, and keeps 2, 4 and 3 positions for the head.
    assert {rows for *_, rows in decoder.small_blocks.exact} == {2, 3, 4}
    assert (1500, 32, 4) in decoder.small_blocks.exact  # the head's
    for a, b in zip(want, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    with decoder.model_products():
        again, _ = _run_steps(model, decoder)
    assert all(torch.equal(a, b) for a, b in zip(want, again, strict=True))
    assert decoder.small_blocks.enabled


def test_the_schedulers_start_up_checks_every_small_block_row_count_before_any_request():
    """A product's first use of a row count is checked (and MKL's first product of a shape is slow): the batched
    scheduler's start-up runs one forward of 2, 3 and 4 tokens, so that a request's first verify is not the one that
    pays for it (the speculation controller prices verifies by what they measured)."""
    from specwire.target_service.scheduler.options import SchedulerOptions
    from specwire.target_service.scheduler.startup_probe import build_slot_cache

    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500)
    setup = build_slot_cache(model, SchedulerOptions(max_batch_rows=2, slot_tokens=64), None)
    assert setup.decoder is not None
    checked = setup.decoder.small_blocks.exact
    assert {rows for *_, rows in checked} == {1, 2, 3, 4}  # one row: timed padded and not (the next tests)
    assert all(checked.get((1500, 32, rows)) is not None for rows in (2, 3, 4))  # the head's, every position's logits


def test_single_rows_pad_one_row_products_and_a_decode_step_stays_bitwise_the_model_forward():
    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500)
    install_slot_attention(model)
    decoder = LeanDecoder(model)
    decoder.small_blocks.single_rows = True
    prompt, step = ([(0, 0, [5, 6, 7, 8])], [3]), ([(0, 4, [9])], [0])
    logits = []
    for forward in (None, decoder):
        cache = SlotKVCache(model, 1, 16)
        with torch.inference_mode():
            logits.append([run_packed(model, cache, pieces, keep, forward) for pieces, keep in (prompt, step)])
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))
    # Every one-row product was checked (and used where its check held): the decode step's and both heads' (the
    # prompt keeps one position).
    assert {key for key in decoder.small_blocks.exact if key[2] == 1} == {
        (32, 32, 1),
        (16, 32, 1),
        (48, 32, 1),
        (32, 48, 1),
        (1500, 32, 1),
    }
    decoder.small_blocks.single_rows = False
    assert not decoder.small_blocks.apply_to(1) and decoder.small_blocks.apply_to(2)


class _SlowOneRowLinear:
    """`torch.nn.functional` with `linear` slowed down on one-row inputs (what MKL's one-thread product is like)."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def linear(hidden, weight, bias=None):
        if hidden.numel() == hidden.shape[-1]:
            time.sleep(0.001)
        return F.linear(hidden, weight, bias)


def _padded_product(slow):
    """A small block's product that holds its check on any machine (the one-row product itself: whether MKL's padded
    product holds for these tiny shapes is MKL's business), `slow` or not on one row."""

    def product(hidden, weight, bias):
        if slow and hidden.numel() == hidden.shape[-1]:
            time.sleep(0.001)
        return F.linear(hidden, weight, bias)

    return product


@pytest.mark.parametrize(("slow", "padded"), [("one-row product", True), ("padded product", False)])
def test_the_schedulers_start_up_pads_one_row_products_only_where_it_measured_that_faster(monkeypatch, slow, padded):
    from specwire.target_service.scheduler.options import SchedulerOptions
    from specwire.target_service.scheduler.startup_probe import build_slot_cache

    if slow == "one-row product":
        monkeypatch.setattr(lean_decoder, "F", _SlowOneRowLinear())
    monkeypatch.setattr(lean_decoder, "_small_block_product", _padded_product(slow == "padded product"))
    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500)
    setup = build_slot_cache(model, SchedulerOptions(max_batch_rows=2, slot_tokens=64), None)
    assert setup.decoder is not None
    assert setup.decoder.small_blocks.single_rows is padded
    assert setup.decoder.small_blocks.exact[(1500, 32, 1)]  # checked either way


def test_a_decoder_without_float32_cpu_products_skips_the_single_row_timing():
    from specwire.target_service.scheduler.options import SchedulerOptions
    from specwire.target_service.scheduler.startup_probe import build_slot_cache

    model = _random("LlamaConfig", "LlamaForCausalLM", vocab_size=1500).to(torch.bfloat16)
    setup = build_slot_cache(model, SchedulerOptions(max_batch_rows=2, slot_tokens=64), None)
    assert setup.decoder is not None and not setup.decoder.has_small_blocks
    assert not setup.decoder.small_blocks.single_rows
    assert setup.decoder.small_blocks.exact == {}


@pytest.mark.parametrize(
    ("config_class", "model_class", "reason"),
    [
        ("Qwen3Config", "Qwen3ForCausalLM", "model type 'qwen3'"),
        ("GPT2Config", "GPT2LMHeadModel", "model type 'gpt2'"),
    ],
)
def test_other_layouts_are_refused_with_a_reason(config_class, model_class, reason):
    import transformers

    if config_class == "GPT2Config":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)
    else:
        config = getattr(transformers, config_class)(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    model = getattr(transformers, model_class)(config)
    assert reason in LeanDecoder.unsupported(model)


def test_a_llama_typed_model_with_q_norms_is_refused():
    model = _random("LlamaConfig", "LlamaForCausalLM")
    model.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    assert LeanDecoder.unsupported(model) == "attention with q/k norms"
