"""Tiny random causal LMs built in-process, saved to a folder and loaded through the real loading code.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on a few sentences, the
model a 2-layer Llama with random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! Speculative decoding is fast.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "for i in range(10):\n    print(i * i)\n",
]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (same decoder family as Llama 3 / SmolLM2) with pad, bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_llama(folder: str | Path, *, seed: int = 0, num_hidden_layers: int = 2, hidden_size: int = 32) -> Path:
    """Save a tiny random Llama and its tokenizer to `folder` and return the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; a larger scale on the head makes distributions peaked
    # enough that greedy and beam choices are not decided by float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_mtp_model(folder: str | Path, *, seed: int = 0) -> Path:
    """Save a tiny random GLM-4.5 (glm4_moe) with one multi-token prediction layer, its MTP weights stored as the
    GLM-4.5-Air checkpoint stores them, and return the folder.

    transformers finds MTP weights by the checkpoint's layer number (`model.layers.46.*` for GLM-4.5-Air), so
    the model has Air's 46 decoder layers, each 32 wide. The MTP layer is made to lean on the target's hidden
    state (its projection passes it through, its attention is damped): its drafts then agree with the target
    often enough, and not always, for the tests to see accepted and rejected drafts.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    folder = Path(folder)
    tokenizer = build_tokenizer()
    layers = 46
    config = Glm4MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=layers,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        num_mtp_layers=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, as build_tiny_llama
    mtp = build_mtp_layers(model, 1, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in mtp.state_dict().items():
        if name.startswith(("embed_tokens.", "shared_head.")):  # the target's own, shared
            continue
        _, index, rest = name.split(".", 2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        weights[f"model.layers.{layers + int(index)}.{rest}"] = tensor.clone().contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def build_mtp_layers(model, num_layers: int, *, seed: int = 0, attention: float = 0.3, mlp: float = 1.0):
    """`num_layers` MTP layers (transformers' `MtpModel`) over `model`, with seeded random weights.

    `MtpModel` leaves some of its weights uninitialised (the experts'), so every one is drawn here. Each layer
    passes the target's hidden state through its projection (`eh_proj` is the identity on that half) and damps
    its attention and MLP outputs by `attention` and `mlp`: its drafts then follow the target's own prediction,
    the tokens before them and its cache enough to be accepted sometimes and rejected sometimes.
    """
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, num_layers).eval()
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mtp.layers.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "e_score_correction_bias" in name:
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        for layer in mtp.layers:
            layer.eh_proj.weight[:, hidden:] = torch.eye(hidden)  # [embeds, hidden] -> mostly the hidden state
            layer.eh_proj.weight[:, :hidden].mul_(0.1)
            layer.mtp_block.self_attn.o_proj.weight.mul_(attention)
            for name, param in layer.mtp_block.mlp.named_parameters():
                if "down_proj" in name:
                    param.mul_(mlp)
    return mtp


def build_tiny_dflash_assistant(
    folder: str | Path,
    *,
    target_layer_ids: tuple[int, ...] = (0, 2),
    block_size: int = 4,
    seed: int = 0,
    attention: float = 4.0,
) -> Path:
    """Save a tiny random DFlash assistant (`MuseGlimmerAssistantModel`, transformers' DFlash class: no LM head,
    it drafts through the target's embeddings and head) for a `build_tiny_llama(num_hidden_layers=4)` target, and
    return the folder (a config and safetensors, no tokenizer: it uses the target's)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    folder = Path(folder)
    config = MuseGlimmerAssistantConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=block_size,
        mask_token_id=3,
        target_layer_ids=list(target_layer_ids),
        max_position_embeddings=256,
        sliding_window=64,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    assistant = MuseGlimmerAssistantModel(config)
    with torch.no_grad():  # attention that weighs: drafts that depend on the context the target's states give
        for layer in assistant.layers:
            layer.self_attn.q_norm.weight.mul_(attention)
            layer.self_attn.o_proj.weight.mul_(attention)
    assistant.save_pretrained(folder)
    return folder
