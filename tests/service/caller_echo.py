"""A servicer that answers with who its handlers saw as the caller (`current_caller()`), for the role tests."""

from __future__ import annotations

import asyncio

from specwire.config.v1 import config_service_pb2 as cpb
from specwire.config.v1 import config_service_pb2_grpc as cpb_grpc
from specwire.security.channels import secure_channel
from specwire.security.identity import current_caller
from specwire.serving import GrpcServer, ServiceBinding
from specwire.target.v1 import target_service_pb2 as tpb
from specwire.target.v1 import target_service_pb2_grpc as tpb_grpc


class CallerEcho(cpb_grpc.ConfigServiceServicer, tpb_grpc.TargetServiceServicer):
    """Answers with `current_caller()` as the handler sees it, read after an await (in the call's task)."""

    async def GetConfig(self, request, context):
        await asyncio.sleep(0)
        return cpb.GetConfigResponse(record=cpb.ConfigRecord(name=current_caller()))

    async def CreateConfig(self, request, context):
        await asyncio.sleep(0)
        return cpb.CreateConfigResponse(record=cpb.ConfigRecord(name=current_caller()))

    async def GenerateStream(self, request, context):
        for _ in range(3):
            await asyncio.sleep(0.01)
            yield tpb.GenerateStreamResponse(delta=tpb.TokenDelta(rows=[tpb.RowDelta(text=current_caller())]))


def echo_server(**kwargs) -> GrpcServer:
    servicer = CallerEcho()
    return GrpcServer(
        [
            ServiceBinding(cpb_grpc.add_ConfigServiceServicer_to_server, servicer, "specwire.config.v1.ConfigService"),
            ServiceBinding(tpb_grpc.add_TargetServiceServicer_to_server, servicer, "specwire.target.v1.TargetService"),
        ],
        **kwargs,
    )


def callers(address: str, token: str | None = None, env=None, write: bool = True) -> tuple[str, str | None, list[str]]:
    """What the echo server's GetConfig, CreateConfig (None unless `write`) and GenerateStream saw as the caller."""
    kwargs = {"env": env} if env is not None else {}
    with secure_channel(address, token=token, **kwargs) as channel:
        config, target = cpb_grpc.ConfigServiceStub(channel), tpb_grpc.TargetServiceStub(channel)
        read = config.GetConfig(cpb.GetConfigRequest(ref="x"), timeout=5).record.name
        made = config.CreateConfig(cpb.CreateConfigRequest(name="x"), timeout=5).record.name if write else None
        stream = [m.delta.rows[0].text for m in target.GenerateStream(tpb.GenerateStreamRequest(), timeout=5)]
    return read, made, stream
