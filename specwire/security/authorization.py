"""The server interceptor that applies an `AccessPolicy` to every call and sets `CALLER` for its handler.

A refused call is answered with the policy's status and message before the handler runs. An accepted
call runs its handler with `specwire.security.identity.CALLER` set to who called (`admin:token`,
`reader:spiffe://...`, `anonymous`), in the task that runs the handler, so the handler's
`current_caller()` reads it.

Without mutual TLS the decision needs only the method and the metadata, so it is made before the
handler is chosen; anonymous calls that are allowed keep their handler as it is (nothing to set: the
variable's default is `anonymous`). With mutual TLS the client certificate is read from the call's
context, so the decision is made inside the wrapped handler.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import grpc

from specwire.security.access import AccessDenied, AccessPolicy
from specwire.security.identity import ANONYMOUS, CALLER
from specwire.security.roles import is_open


def _authorization(metadata: Any) -> list[str]:
    return [value for key, value in (metadata or ()) if key == "authorization" and isinstance(value, str)]


def _peer_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The client certificate's identities (its SANs, else its common name), as gRPC reports them."""
    identities = context.peer_identities() or ()
    return [i.decode(errors="replace") if isinstance(i, bytes) else str(i) for i in identities]


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes every call by `policy` (health and reflection stay open).

    Args:
        policy (`AccessPolicy`): the server's credentials, flags and the method -> role table.
    """

    def __init__(self, policy: AccessPolicy):
        self.policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or is_open(method):
            return handler
        authorization = _authorization(handler_call_details.invocation_metadata)
        policy = self.policy
        if policy.mutual_tls:
            return _wrap(handler, lambda context: policy.authorize(method, authorization, _peer_identities(context)))
        try:
            caller = policy.authorize(method, authorization)
        except AccessDenied as exc:
            denied = exc
            return _wrap(handler, lambda context: _raise(denied))
        if caller == ANONYMOUS:
            return handler
        return _wrap(handler, lambda context: caller)


def _raise(denied: AccessDenied) -> str:
    raise denied


def _reset(token: Any) -> None:
    try:
        CALLER.reset(token)
    except ValueError:  # an async generator finalised in another context: that context ends anyway
        pass


def _wrap(handler: grpc.RpcMethodHandler, decide: Callable[[Any], str]) -> grpc.RpcMethodHandler:
    """`handler` whose behaviour first runs `decide(context)` (the caller, or `AccessDenied`), then runs
    with `CALLER` set to the caller."""
    behavior = handler.stream_stream or handler.unary_stream or handler.stream_unary or handler.unary_unary

    async def caller_or_abort(context: grpc.aio.ServicerContext) -> str:
        try:
            return decide(context)
        except AccessDenied as denied:
            await context.abort(denied.code, denied.message)
            raise  # unreachable: abort raises

    if handler.response_streaming:

        async def streaming(request, context):
            token = CALLER.set(await caller_or_abort(context))
            try:
                results = behavior(request, context)
                if inspect.isasyncgen(results):
                    # Closed here when this stream ends early (a cancel): its cleanup runs now, not at GC.
                    async with contextlib.aclosing(results):
                        async for item in results:
                            yield item
                elif hasattr(results, "__aiter__"):
                    async for item in results:
                        yield item
                else:
                    for item in results:
                        yield item
            finally:
                _reset(token)

        wrapped: Callable = streaming
    else:

        async def unary(request, context):
            token = CALLER.set(await caller_or_abort(context))
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                _reset(token)

        wrapped = unary
    streams = "_stream" if handler.response_streaming else "_unary"
    kind = ("stream" if handler.request_streaming else "unary") + streams
    return handler._replace(**{kind: wrapped})
