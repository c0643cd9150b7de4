"""The in-process transformers side: `model.generate()` on the weights specwire serves.

The target model is loaded with `specwire.models.load_model`, so transformers runs on exactly the
weights the target service loads, and the draft model is the one the draft service loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.progress import log


def load_draft(name: str, target_loaded: Any = None, device: str = "cpu", dtype: str = "float32") -> tuple[Any, str]:
    """The draft model for transformers' assisted generation, and a note on how it was made.

    `default-int8` is made from the already loaded target weights (when they are float32 on the CPU)
    with the same `specwire.models.quantize_int8` the draft service uses, so the GGUF is not loaded twice.
    """
    from specwire.models import load_model, quantize_int8

    reusable = target_loaded is not None and target_loaded.device.type == "cpu" and target_loaded.dtype == torch.float32
    if name == "default-int8" and reusable:
        return quantize_int8(target_loaded, progress=False).model, "default-int8 (specwire.models.quantize_int8)"
    loaded = load_model(name, device=device, dtype=dtype, progress=False)
    return loaded.model, f"{name} via specwire.models.load_model on {loaded.device}"


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        # generate() first puts the prompt, then each step's new tokens.
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            if value.is_cuda:
                torch.cuda.synchronize(value.device)  # the token exists once its kernels have run
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Run:
    """One timed generation."""

    seconds: float
    new_tokens: int
    sequence: list[int]  # first output row, prompt included
    ttft: float | None = None
    # A stream's `(new tokens so far, seconds since the request was sent)` at each token delta.
    arrivals: list[tuple[int, float]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Reference:
    """transformers' `generate()` in this process, on the model the target service serves.

    Args:
        model_name (`str`): as the target service's `--model`.
        device, dtype (`str`): as the target service's `--device` and `--dtype`.
        draft_device, draft_dtype (`str`): the assistant's device and dtype (as the draft service's).
    """

    def __init__(
        self,
        model_name: str,
        device: str = "cpu",
        dtype: str = "float32",
        draft_device: str = "cpu",
        draft_dtype: str = "float32",
    ):
        from specwire.models import load_model

        started = time.perf_counter()
        self.loaded = load_model(model_name, device=device, dtype=dtype, progress=False)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.device = self.loaded.device
        self.draft_device, self.draft_dtype = draft_device, draft_dtype
        log(
            f"transformers reference loaded {self.loaded.model_id} on {self.device} as "
            f"{str(self.loaded.dtype).removeprefix('torch.')} in {time.perf_counter() - started:.1f}s"
        )
        self._draft = None
        self.draft_note = ""

    def draft(self, name: str) -> Any:
        if self._draft is None:
            started = time.perf_counter()
            self._draft, self.draft_note = load_draft(name, self.loaded, self.draft_device, self.draft_dtype)
            log(f"transformers reference draft ready ({self.draft_note}) in {time.perf_counter() - started:.1f}s")
        return self._draft

    def float32_bytes(self) -> int:
        """Size of the target's weights in float32 (parameters and buffers)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        seen, total = set(), 0
        for tensor in tensors:
            if tensor.data_ptr() in seen:
                continue  # tied weights (embeddings and LM head) count once
            seen.add(tensor.data_ptr())
            total += tensor.numel() * 4
        return total

    def encode(self, text: str, chat: bool = True) -> list[int]:
        """Prompt token ids, with the chat template when the tokenizer has one (as the service does)."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        *,
        seed: int | None = None,
        ttft: bool = False,
        assistant: Any = None,
        **kwargs,
    ) -> Run:
        """Time one `model.generate()` call; `kwargs` are generation arguments."""
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        streamer = _FirstTokenTimer() if ttft else None
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        if seed is not None:
            torch.manual_seed(seed)
        started = time.perf_counter()
        output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs)
        if output.is_cuda:
            torch.cuda.synchronize(output.device)
        seconds = time.perf_counter() - started
        sequence = output[0].tolist()
        first = None if streamer is None or streamer.first_token_at is None else streamer.first_token_at - started
        return Run(seconds, len(sequence) - len(prompt), sequence, first)
