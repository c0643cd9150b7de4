"""Token healing's forwards run on the model thread (the batched scheduler's, or the sequential engine's
worker), never on the preparation pool's threads, and stop once the caller's deadline has passed. The tiny
tokenizer heals "def ad" (its last token has several extensions), so healing really calls the model."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from specwire.client import TargetClient
from specwire.deadline import set_caller_deadline
from specwire.errors import DeadlineExceeded
from specwire.generation.healing import heal_same_shape
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.requests import _Deadlined
from tests.servers import threaded_server

PROMPT = "def ad"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def _prompt_ids(loaded) -> torch.Tensor:
    return loaded.tokenizer([PROMPT], return_tensors="pt").input_ids


@pytest.mark.parametrize("scheduler", ["batched", "sequential"])
def test_healing_forwards_run_on_the_model_thread(loaded, scheduler):
    prompt_length = _prompt_ids(loaded).shape[1]
    threads: list[tuple[str, int]] = []
    hook = loaded.model.register_forward_hook(
        lambda module, args, kwargs, output: threads.append(
            (threading.current_thread().name, kwargs["input_ids"].shape[1])
        ),
        with_kwargs=True,
    )
    try:
        with threaded_server(lambda: build_target_server(loaded, scheduler=scheduler)) as server:
            with TargetClient(server.address) as client:
                out = client.generate(text=[PROMPT], token_healing=True, max_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    healing = [name for name, length in threads if length == prompt_length - 1]  # the row without its tail
    assert healing, f"healing ran no forward: {threads}"
    assert all(name.startswith(("specwire-scheduler", "specwire-model")) for name, _ in threads), threads
    assert out.sequences.shape[1] == prompt_length + 2


def test_healing_stops_when_the_callers_deadline_has_passed(loaded):
    def heal_late():
        set_caller_deadline(0.0)
        return heal_same_shape(_Deadlined(loaded.model), loaded.tokenizer, _prompt_ids(loaded))

    with pytest.raises(DeadlineExceeded, match="healed"):
        contextvars.copy_context().run(heal_late)
    # Without a deadline it heals.
    healed = contextvars.copy_context().run(
        heal_same_shape, _Deadlined(loaded.model), loaded.tokenizer, _prompt_ids(loaded)
    )
    assert healed.shape == _prompt_ids(loaded).shape
