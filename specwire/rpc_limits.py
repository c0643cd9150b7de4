"""A cap on the RPCs a server runs at once, refused early with RESOURCE_EXHAUSTED and a retry hint.

grpc.aio's own `maximum_concurrent_rpcs` refuses with a bare message: no `retry-after-s` hint, and
it counts health checks and reflection too, so a loaded server would fail its probes and be
restarted, losing every request in flight. This interceptor counts only the application's RPCs
(health and reflection stay open) and refuses before the handler runs, with the hint in the
trailing metadata like every other RESOURCE_EXHAUSTED of specwire.
"""

from __future__ import annotations

import inspect

import grpc

from specwire.errors import ResourceExhausted
from specwire.security.roles import OPEN_SERVICES


class ConcurrencyLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls beyond `max_concurrent_rpcs` running at once (streams count until they end).

    Args:
        max_concurrent_rpcs (`int`): RPCs (unary calls and open streams) served at once.
        retry_after_s (`float`, defaults to 1.0): the retry hint sent with a refusal.
    """

    def __init__(self, max_concurrent_rpcs: int, retry_after_s: float = 1.0):
        if max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.retry_after_s = retry_after_s
        self.active = 0  # only touched on the server's event loop

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        return self._wrap(handler)

    async def _refuse(self, context) -> None:
        from specwire.serving import error_status  # serving imports this module

        error = ResourceExhausted(
            f"the server is serving {self.active} calls, its limit (--max-concurrent-rpcs "
            f"{self.max_concurrent_rpcs}); retry later",
            retry_after_s=self.retry_after_s,
        )
        code, message, metadata = error_status(error)
        await context.abort(code, message, trailing_metadata=metadata)

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler.stream_stream or handler.unary_stream or handler.stream_unary or handler.unary_unary
        limiter = self

        if inspect.isasyncgenfunction(behavior):

            async def limited_stream(request, context):
                if limiter.active >= limiter.max_concurrent_rpcs:
                    await limiter._refuse(context)
                limiter.active += 1
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    limiter.active -= 1

            wrapped = limited_stream
        else:

            async def limited(request, context):
                if limiter.active >= limiter.max_concurrent_rpcs:
                    await limiter._refuse(context)
                limiter.active += 1
                try:
                    return await behavior(request, context)
                finally:
                    limiter.active -= 1

            wrapped = limited
        if handler.request_streaming and handler.response_streaming:
            factory = grpc.stream_stream_rpc_method_handler
        elif handler.response_streaming:
            factory = grpc.unary_stream_rpc_method_handler
        elif handler.request_streaming:
            factory = grpc.stream_unary_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        return factory(wrapped, handler.request_deserializer, handler.response_serializer)
