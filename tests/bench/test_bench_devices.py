"""`python -m bench --device/--dtype/--draft-device`: where each side runs, checked before anything starts."""

from __future__ import annotations

import pytest
import torch

from bench.__main__ import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("option", ["--device", "--draft-device"])
def test_cuda_without_a_gpu_fails_before_any_service_starts(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", option, "cuda", "--out", "unused"])
    message = str(exit_.value)
    assert message.startswith(f"{option}: device 'cuda' was requested but CUDA is not available")
    assert "starting" not in capsys.readouterr().err  # no service was started


def test_unknown_device_is_rejected():
    with pytest.raises(SystemExit, match="--device: device 'tpu' is not a valid torch device"):
        main(["--quick", "--device", "tpu", "--out", "unused"])


@pytest.mark.parametrize("arg", ["--device=cuda", "--dtype=bfloat16"])
def test_target_arg_cannot_move_only_the_services(arg):
    with pytest.raises(SystemExit, match="pass the bench's own --device/--dtype instead"):
        main(["--quick", f"--target-arg={arg}", "--out", "unused"])


def test_int8_default_draft_stays_on_the_cpu(monkeypatch):
    # Pretend a GPU is visible so that only the draft's own CPU-only rule can refuse.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="the default-int8 draft runs on the CPU only"):
        main(["--quick", "--device", "cuda", "--draft-device", "cuda", "--out", "unused"])
