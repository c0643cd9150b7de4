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
