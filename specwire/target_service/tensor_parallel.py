"""`target-service --tensor-parallel N` and `torchrun --nproc-per-node N -m specwire.target_service`.

Two ways to start the ranks of a tensor-parallel target (`specwire.models.tensor_parallel`):

- `--tensor-parallel N`: this process becomes rank 0 and starts ranks 1..N-1 itself, as child
  processes running the same command line with torchrun's environment variables (`RANK`,
  `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`). The children watch
  their parent and exit when it is gone; rank 0 watches them and stops the service (health
  NOT_SERVING, then the same graceful stop as SIGTERM) when one exits, so the ranks never wait on
  each other's collectives forever.
- under `torchrun` (the environment already says `WORLD_SIZE` > 1): every process loads its shard,
  rank 0 serves and the rest follow; torchrun stops the whole group when one of them fails.

Both schedulers serve under TP (the followers mirror the batched scheduler's slot cache, see the core
module's docstring); packed forwards run through transformers' forward (`--packed-forward lean` is
refused: the lean decoder would skip the sharded layers' collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from specwire.models import LoadedModel, ModelLoadError, load_model, model_config
from specwire.models.loader import DEFAULT_INT8_NAME
from specwire.models.tensor_parallel import (
    MirroredModel,
    TensorParallelWorld,
    follow,
    init_world,
    tp_support,
)

log = logging.getLogger("specwire.target_service.tensor_parallel")

# Set on the ranks this process starts: the pid of rank 0, which they watch.
PARENT_ENV = "SPECWIRE_TP_PARENT"
# Seconds followers get to exit after rank 0's stop message before they are terminated.
_STOP_WAIT_S = 10.0


def world_size_from_env() -> int:
    """The ranks torchrun (or rank 0 of `--tensor-parallel`) started, 1 outside a distributed launch."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Followers:
    """The ranks 1..N-1 rank 0 started (`--tensor-parallel N`), and the watch over them.

    Args:
        world_size (`int`): N, the ranks in all (>= 2).
        argv (`Sequence[str]`): the service's command-line arguments, which every rank runs.
    """

    def __init__(self, world_size: int, argv: Sequence[str]):
        self.world_size = world_size
        self.problem = ""  # why the service must stop: a follower exited
        self.grace: float | None = None  # seconds in-flight requests get then; None until serving
        self._stopping = False
        port = _free_port()
        base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
        os.environ.update(RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ["WORLD_SIZE"] = str(world_size)
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), **{PARENT_ENV: str(os.getpid())})
            command = [sys.executable, "-m", "specwire.target_service", *argv]
            self.processes.append(subprocess.Popen(command, env=env))
        log.info(
            "tensor parallel: started ranks 1..%d (pids %s), rendezvous 127.0.0.1:%d",
            world_size - 1,
            [process.pid for process in self.processes],
            port,
        )

    def _exited(self, reason: str) -> None:
        if self.grace is None:  # still starting: nothing to drain, and no signal handler to stop gracefully
            log.error("tensor parallel: exiting before serving: %s", reason)
            os._exit(1)
        stop_self(reason, self.grace)

    def watch(self) -> None:
        """From a daemon thread: when a follower exits before `stop`, stop this server (`stop_self`, with
        `grace` once serving) or, while starting, exit at once."""

        def run() -> None:
            while not self._stopping:
                for rank, process in enumerate(self.processes, start=1):
                    code = process.poll()
                    if code is not None and not self._stopping:
                        self.problem = (
                            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}: "
                            "the target cannot run forwards without it and stops; see that rank's log"
                        )
                        log.error("%s", self.problem)
                        self._exited(self.problem)
                        return
                time.sleep(0.2)

        threading.Thread(target=run, name="specwire-tp-watch", daemon=True).start()

    def stop(self) -> None:
        """Waits for the followers to exit (after rank 0's stop message), terminating the late ones."""
        self._stopping = True
        deadline = time.monotonic() + _STOP_WAIT_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower pid %d did not stop: killing it", process.pid)
                process.kill()
                process.wait()


def stop_self(reason: str, grace: float) -> None:
    """Stops this server as SIGTERM does, and exits outright if that has not ended it within `grace`
    + 10 seconds (a forward stuck in a collective with a dead rank must not keep the pod alive)."""

    def hard_exit() -> None:
        time.sleep(grace + 10.0)
        log.error("tensor parallel: the service did not stop in time after: %s; exiting", reason)
        os._exit(1)

    threading.Thread(target=hard_exit, name="specwire-tp-exit", daemon=True).start()
    os.kill(os.getpid(), signal.SIGTERM)


def watch_parent() -> None:
    """On a follower started by rank 0 (`PARENT_ENV`): exit as soon as rank 0 is gone, whatever the
    follower is doing (waiting for a broadcast never returns if rank 0 was killed)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    # Ctrl-C reaches the whole process group; rank 0 handles it and stops its followers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = int(parent)

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=run, name="specwire-tp-parent", daemon=True).start()


def tensor_parallel_size(args: argparse.Namespace) -> int:
    """The ranks the model is sharded over: torchrun's `WORLD_SIZE`, else `--tensor-parallel` (exits
    with the reason when they disagree or the size is not a positive number)."""
    launched = world_size_from_env()
    asked = args.tensor_parallel
    if asked is not None and asked < 1:
        raise SystemExit(f"target-service: --tensor-parallel {asked} must be >= 1 (1: no sharding)")
    if launched > 1 and asked not in (None, launched):
        raise SystemExit(
            f"target-service: --tensor-parallel {asked} disagrees with WORLD_SIZE={launched} of the launcher "
            "(torchrun): leave --tensor-parallel out under torchrun, or run without torchrun"
        )
    return launched if launched > 1 else int(asked or 1)


@dataclasses.dataclass
class Target:
    """The served model and, under tensor parallelism, the ranks behind it.

    Args:
        loaded (`LoadedModel`): the model the service serves (rank 0's `MirroredModel` under TP).
        mirrored (`MirroredModel`, *optional*): rank 0's broadcasting wrapper.
        followers (`Followers`, *optional*): the ranks this process started (`--tensor-parallel`).
    """

    loaded: LoadedModel
    mirrored: MirroredModel | None = None
    followers: Followers | None = None

    def problem(self) -> str:
        """Why the ranks can no longer serve ("" when they can)."""
        if self.followers is not None and self.followers.problem:
            return self.followers.problem
        return self.mirrored.broken if self.mirrored is not None else ""

    def watch(self, server: Any, grace: float) -> None:
        """Health follows the ranks too; a follower exiting stops the server (see `Followers`)."""
        if self.mirrored is None:
            return
        own = server.liveness

        def liveness() -> str:
            return self.problem() or (own() if own is not None else "")

        server.liveness = liveness
        if self.followers is not None:
            self.followers.grace = grace

    def close(self) -> None:
        """Stops the followers (rank 0's stop message, then waits), after the server stopped; exits
        non-zero when a follower's exit was what stopped it."""
        if self.mirrored is not None:
            self.mirrored.stop()
        if self.followers is not None:
            self.followers.stop()
            if self.followers.problem:
                raise SystemExit(f"target-service: {self.followers.problem}")


def _check_support(args: argparse.Namespace, world_size: int) -> str:
    """The device type to shard on; exits with the reason when transformers' TP cannot shard the model."""
    import torch

    try:
        device_type = torch.device(args.device).type
        config = model_config(args.model)
    except (RuntimeError, ModelLoadError) as error:
        raise SystemExit(f"target-service: {error}") from None
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(
            f"target-service: --device {args.device} with tensor parallelism: give 'cpu' or 'cuda' (each rank "
            "takes GPU LOCAL_RANK)"
        )
    if args.model == DEFAULT_INT8_NAME:
        problem = "dynamic int8 layers cannot be sharded: use 'default' or another float model"
    else:
        problem = tp_support(config, world_size, device_type)
    if problem:
        raise SystemExit(f"target-service: --tensor-parallel {world_size} cannot shard {args.model}: {problem}")
    return device_type


def _load_shard(args: argparse.Namespace, world: TensorParallelWorld) -> LoadedModel:
    try:
        loaded = load_model(args.model, device=world.device, dtype=args.dtype, tensor_parallel=True)
    except ModelLoadError as error:
        raise SystemExit(f"target-service: rank {world.rank}: {error}") from None
    if args.attn_implementation is not None:
        loaded.model.set_attn_implementation(args.attn_implementation)
    return loaded


def load_target(args: argparse.Namespace, world_size: int, argv: Sequence[str]) -> Target:
    """Loads the model to serve: on one device, or rank 0's shard (starting the other ranks first when
    this process was not launched by torchrun). Exits with the reason when it cannot."""
    if world_size == 1:
        try:
            loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        except ModelLoadError as error:  # what was tried and the fix, without a traceback
            raise SystemExit(f"target-service: {error}") from None
        if args.attn_implementation is not None:
            loaded.model.set_attn_implementation(args.attn_implementation)
        return Target(loaded)
    device_type = _check_support(args, world_size)
    followers = Followers(world_size, argv) if world_size_from_env() == 1 else None
    if followers is not None:  # from now on: a follower failing to start or load ends rank 0 too
        followers.watch()
    world = init_world(device_type)
    loaded = _load_shard(args, world)
    mirrored = MirroredModel(loaded.model, world)
    log.info(
        "tensor parallel: serving rank 0 of %d (%s backend)", world_size, "nccl" if device_type == "cuda" else "gloo"
    )
    return Target(dataclasses.replace(loaded, model=mirrored), mirrored, followers)


def run_follower(args: argparse.Namespace) -> None:
    """A follower rank's whole life: load its shard, then replay rank 0's model work until rank 0 stops.
    Exits the process with the reason when anything fails (rank 0's watch then stops the service)."""
    watch_parent()
    rank = rank_from_env()
    device_type = _check_support(args, world_size_from_env())
    try:
        world = init_world(device_type)
        loaded = _load_shard(args, world)
        follow(loaded.model, world)
    except SystemExit:
        raise
    except Exception as error:  # noqa: BLE001 -- any failure ends this rank with its reason, not a hang
        log.exception("tensor-parallel rank %d failed", rank)
        raise SystemExit(f"target-service: tensor-parallel rank {rank} failed: {error}") from None
