"""`specwire.model_thread`: the thread that runs forwards keeps the process's torch thread count even
after other threads went single-threaded (torch initialises a new thread's count from the last one
any thread set)."""

from __future__ import annotations

import threading

import pytest
import torch

from specwire.model_thread import claim_torch_threads, model_executor


def _in_new_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join(30)
    return out["value"]


@pytest.fixture
def two_threads():
    """Two torch threads for the test (the suite's processes run one, `tests/conftest.py`), the count before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_claim_keeps_the_count_after_another_thread_set_one(two_threads):
    def helper():
        torch.set_num_threads(1)  # a request thread going single-threaded
        return torch.get_num_threads()

    assert _in_new_thread(helper) == 1
    # torch's behaviour this module exists for: a fresh thread inherits the last count set anywhere.
    assert _in_new_thread(torch.get_num_threads) == 1

    def claimed():
        claim_torch_threads(two_threads)
        return torch.get_num_threads()

    assert _in_new_thread(claimed) == two_threads


def test_model_executor_threads_get_the_count_of_its_creator(two_threads):
    executor = model_executor("test-model")
    try:
        _in_new_thread(lambda: torch.set_num_threads(1))
        assert executor.submit(torch.get_num_threads).result(30) == two_threads
        assert executor.submit(lambda: threading.current_thread().name).result(30).startswith("test-model")
    finally:
        executor.shutdown()
