"""`specwire.model_thread`: the thread that runs forwards keeps the process's torch thread count even
after other threads went single-threaded (torch initialises a new thread's count from the last one
any thread set); closing it waits a bound, then names a thread that did not end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specwire import model_thread
from specwire.model_thread import ModelExecutor, claim_torch_threads


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


def test_model_executors_thread_gets_the_count_of_its_creator(two_threads):
    executor = ModelExecutor("test-model")
    try:
        _in_new_thread(lambda: torch.set_num_threads(1))
        assert executor.submit(torch.get_num_threads).result(30) == two_threads
        assert executor.submit(lambda: threading.current_thread().name).result(30).startswith("test-model")
    finally:
        executor.shutdown()


def test_closing_a_model_executor_reports_a_thread_stuck_in_its_work(monkeypatch, caplog):
    """`close` waits its bound for the running work, then names the thread that did not end (`stuck_threads`,
    which the service's `exit_if_stuck` exits past); a thread that ends in time is not named."""
    monkeypatch.setattr(model_thread, "_stuck", [])
    quick = ModelExecutor("test-quick")
    quick.submit(time.sleep, 0.05).result()
    quick.close(5.0)
    assert model_thread.stuck_threads() == []
    release = threading.Event()
    stuck = ModelExecutor("test-stuck")
    started = threading.Event()
    stuck.submit(lambda: started.set() or release.wait(30))
    assert started.wait(10)
    left = stuck.submit(lambda: None)  # waiting behind it: dropped by close
    began = time.monotonic()
    stuck.close(0.3)
    assert 0.3 <= time.monotonic() - began < 5
    assert model_thread.stuck_threads() == [stuck.thread.name] and stuck.thread.name.startswith("test-stuck")
    assert left.cancelled()
    assert any("stuck on its device" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    release.set()
    stuck.thread.join(10)
