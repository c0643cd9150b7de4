"""A request abandoned while the server shuts down: its steps are finalised after the executor they ran
on has stopped, and they must still be closed (no "cannot schedule new futures after shutdown" left in a
task nobody reads, no request counted as active forever)."""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor

import torch

from specwire.generation.config import GenerationConfig
from specwire.models import load_model
from specwire.target_service.engine import Engine
from specwire.target_service.requests import GenerationJob


def test_steps_abandoned_after_the_executor_stopped_are_closed(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    engine = Engine(loaded, scheduler="sequential")
    started = []
    start = engine._start
    engine._start = lambda *args, **kwargs: started.append(start(*args, **kwargs)) or started[-1]
    job = GenerationJob(
        input_ids=torch.tensor([[5, 6, 7, 8]]),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        config=GenerationConfig(max_new_tokens=50, do_sample=False),
        request_id="abandoned",
    )

    async def abandon() -> None:
        executor = ThreadPoolExecutor(1)
        events = engine._run_one_per_step(job, executor, model=loaded.model)
        await events.__anext__()  # the request runs...
        assert engine.active == 1
        executor.shutdown(wait=True)  # ...the server stops its model thread...
        await events.aclose()  # ...and the abandoned request is finalised

    asyncio.run(abandon())
    assert engine.active == 0
    assert inspect.getgeneratorstate(started[0]) == inspect.GEN_CLOSED
