"""`specwire.common.v1.DenseTensor` <-> torch tensors (raw little-endian row-major bytes)."""

from __future__ import annotations

import numpy as np
import torch

from specwire.common.v1 import common_pb2

_TORCH_TO_WIRE = {
    torch.float32: common_pb2.D_TYPE_FLOAT32,
    torch.float16: common_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: common_pb2.D_TYPE_BFLOAT16,
    torch.int32: common_pb2.D_TYPE_INT32,
    torch.int64: common_pb2.D_TYPE_INT64,
    torch.bool: common_pb2.D_TYPE_BOOL,
}
_WIRE_TO_TORCH = {v: k for k, v in _TORCH_TO_WIRE.items()}


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.DenseTensor:
    """A tensor as raw little-endian row-major bytes with dtype and shape."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in _TORCH_TO_WIRE:
        raise TypeError(f"no wire dtype for {tensor.dtype}")
    # bfloat16 has no numpy dtype: ship its bits as int16.
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return common_pb2.DenseTensor(
        dtype=_TORCH_TO_WIRE[tensor.dtype], shape=list(tensor.shape), data=raw.numpy().tobytes()
    )


def tensor_from_proto(message: common_pb2.DenseTensor) -> torch.Tensor:
    """The tensor a DenseTensor carries (a fresh, writable copy)."""
    dtype = _WIRE_TO_TORCH.get(message.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {message.dtype}")
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    np_dtype = torch.empty(0, dtype=carrier).numpy().dtype
    array = np.frombuffer(message.data, dtype=np_dtype).copy()
    tensor = torch.from_numpy(array).reshape(tuple(message.shape))
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
