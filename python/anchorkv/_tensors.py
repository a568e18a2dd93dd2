"""Turn array objects into (pointer, shape, element strides, dtype, device) without copying.

Accepted, in this order:
  - numpy.ndarray (float32, float16, uint16/int16 raw bits with an explicit dtype, and the
    ml_dtypes bfloat16 dtype when present);
  - any object with __dlpack__ (torch, CuPy, JAX, numpy), CPU or CUDA memory; bf16 included;
  - any object with __cuda_array_interface__ (CuPy, Numba, torch);
  - anything numpy.asarray accepts (lists: copied once, which is the only copy made here).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._enums import DType
from ._errors import InvalidArgumentError, MismatchError

CPU = "cpu"
CUDA = "cuda"


@dataclass
class TensorView:
    """A borrowed view of someone else's memory. `owner` keeps that memory alive."""

    pointer: int
    shape: tuple
    strides: tuple  # in elements
    dtype: DType | None  # None: integer data (positions)
    device: str
    device_index: int
    owner: Any
    kind: str  # "numpy", "torch", "cupy" or "other": decides how results are allocated

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# ---- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html), the unversioned capsule ------

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4


class _DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", _DLDevice), ("ndim", c_int32),
                ("dtype", _DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class _DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _kind_of(obj) -> str:
    module = type(obj).__module__.split(".")[0]
    return module if module in ("numpy", "torch", "cupy") else "other"


def _element_dtype(code: int, bits: int, requested: DType | None, name: str) -> DType | None:
    """Map a (DLPack-style) element type to DType; raw 16-bit integers need `requested`."""
    if code == _DL_FLOAT and bits == 32:
        found = DType.F32
    elif code == _DL_FLOAT and bits == 16:
        found = DType.F16
    elif code == _DL_BFLOAT and bits == 16:
        found = DType.BF16
    elif code in (_DL_INT, _DL_UINT) and bits == 16:
        if requested in (DType.F16, DType.BF16):
            return requested
        raise InvalidArgumentError(
            f"{name} holds raw 16-bit integers: pass dtype='bf16' or dtype='f16' to say what they are")
    elif code == _DL_INT and bits == 32 and requested is None:
        return None
    else:
        raise InvalidArgumentError(f"{name} has an unsupported element type (code {code}, {bits} bits)")
    if requested not in (None, DType.AUTO) and requested != found:
        raise InvalidArgumentError(f"{name} holds {found.name} but dtype={requested.name} was given")
    return found


def _from_numpy(array: np.ndarray, requested, name, expect_int32, writable=False) -> TensorView:
    if writable and not array.flags.writeable:
        raise InvalidArgumentError(f"{name} is read-only")
    if expect_int32:
        if array.dtype != np.int32:
            raise InvalidArgumentError(f"{name} must be int32, got {array.dtype}")
        dtype = None
    elif array.dtype == np.float32:
        dtype = _element_dtype(_DL_FLOAT, 32, requested, name)
    elif array.dtype == np.float16:
        dtype = _element_dtype(_DL_FLOAT, 16, requested, name)
    elif array.dtype.name == "bfloat16" and array.dtype.itemsize == 2:  # ml_dtypes
        dtype = _element_dtype(_DL_BFLOAT, 16, requested, name)
    elif array.dtype in (np.uint16, np.int16):
        dtype = _element_dtype(_DL_UINT, 16, requested, name)
    else:
        raise InvalidArgumentError(f"{name} has dtype {array.dtype}; use float32, float16, or "
                                   "uint16 bits with dtype='bf16'/'f16'")
    itemsize = array.dtype.itemsize
    if any(stride % itemsize for stride in array.strides):
        raise InvalidArgumentError(f"{name} has strides that are not whole elements")
    return TensorView(array.ctypes.data, tuple(array.shape),
                      tuple(stride // itemsize for stride in array.strides), dtype, CPU, 0,
                      array, "numpy")


def _from_dlpack(obj, requested, name, expect_int32, stream) -> TensorView:
    device_type, device_id = obj.__dlpack_device__()
    device_type = int(device_type)
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        if stream is None:
            stream = current_stream_of(obj, device_id)
        # The producer orders its pending work before `stream` (1 = the legacy default).
        capsule = obj.__dlpack__(stream=stream if stream else 1)
        device = CUDA
    elif device_type in (_DL_CPU, _DL_CUDA_HOST):
        capsule = obj.__dlpack__()
        device = CPU
    else:
        raise MismatchError(f"{name} lives on DLPack device type {device_type}; only CPU and CUDA memory are supported")
    address = _capsule_get_pointer(capsule, b"dltensor")
    tensor = _DLManagedTensor.from_address(address).dl_tensor
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    if tensor.dtype.lanes != 1:
        raise InvalidArgumentError(f"{name} has vector lanes")
    if expect_int32:
        if not (tensor.dtype.code == _DL_INT and tensor.dtype.bits == 32):
            raise InvalidArgumentError(f"{name} must be int32")
        dtype = None
    else:
        dtype = _element_dtype(tensor.dtype.code, tensor.dtype.bits, requested, name)
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(ndim))
    else:  # NULL strides: compact row-major
        strides, running = [], 1
        for extent in reversed(shape):
            strides.append(running)
            running *= extent
        strides = tuple(reversed(strides))
    # The capsule stays unconsumed: when it is collected (with the view), its destructor
    # calls the producer's deleter, which releases the producer's reference.
    return TensorView((tensor.data or 0) + tensor.byte_offset, shape, strides, dtype, device,
                      device_id if device == CUDA else 0, (obj, capsule), _kind_of(obj))


_TYPESTR = {"f4": (_DL_FLOAT, 32), "f2": (_DL_FLOAT, 16), "u2": (_DL_UINT, 16),
            "i2": (_DL_INT, 16), "i4": (_DL_INT, 32)}


def _from_cuda_array_interface(obj, interface, requested, name, expect_int32) -> TensorView:
    typestr = interface["typestr"]
    if typestr[0] not in "<|=" or typestr[1:] not in _TYPESTR:
        raise InvalidArgumentError(f"{name} has unsupported typestr {typestr!r}")
    code, bits = _TYPESTR[typestr[1:]]
    if expect_int32:
        if (code, bits) != (_DL_INT, 32):
            raise InvalidArgumentError(f"{name} must be int32")
        dtype = None
    else:
        dtype = _element_dtype(code, bits, requested, name)
    itemsize = bits // 8
    shape = tuple(interface["shape"])
    if interface.get("strides") is None:
        strides, running = [], 1
        for extent in reversed(shape):
            strides.append(running)
            running *= extent
        strides = tuple(reversed(strides))
    else:
        strides = tuple(stride // itemsize for stride in interface["strides"])
    pointer = interface["data"][0] or 0
    device_index = 0
    try:  # The interface does not carry the device; torch and CuPy objects know it.
        device_index = int(getattr(obj, "device").index or 0) if hasattr(obj, "device") else 0
    except (AttributeError, TypeError, ValueError):
        device_index = 0
    return TensorView(pointer, shape, strides, dtype, CUDA, device_index, obj, _kind_of(obj))


def view(obj, *, name: str, dtype: DType | None = None, expect_int32: bool = False,
         stream: int | None = None, writable: bool = False) -> TensorView:
    """A TensorView of `obj`, copying only when obj is not an array at all (e.g. a list).

    `stream`: for CUDA producers, the stream the library will use (None: the producer's
    current stream), so that DLPack orders the producer's pending work before it.
    """
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, dtype, name, expect_int32, writable)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            return _from_dlpack(obj, dtype, name, expect_int32, stream)
        except (BufferError, RuntimeError, TypeError):
            pass  # e.g. torch refuses tensors that require grad; try the next protocol
    try:
        interface = obj.__cuda_array_interface__
    except (AttributeError, TypeError, RuntimeError):
        interface = None
    if interface is not None:
        return _from_cuda_array_interface(obj, interface, dtype, name, expect_int32)
    if hasattr(obj, "__dlpack__"):  # the protocol failed above: say why
        return _from_dlpack(obj, dtype, name, expect_int32, stream)
    if writable:
        raise InvalidArgumentError(f"{name} must be an array the library can write into")
    array = np.asarray(obj)
    if array.dtype.kind not in "biuf":  # e.g. object(): numpy would raise float()'s TypeError
        raise TypeError(f"{name} must be an array (numpy, or with __dlpack__ or "
                        f"__cuda_array_interface__) or a sequence of numbers, not "
                        f"{type(obj).__name__}")
    if expect_int32:
        return _from_numpy(np.ascontiguousarray(array, dtype=np.int32), None, name, True)
    if array.dtype not in (np.float32, np.float16, np.uint16, np.int16):
        array = array.astype(np.float32)  # a plain list of numbers
    return _from_numpy(np.ascontiguousarray(array), dtype, name, False)


def contiguous(tensor: TensorView, *, name: str) -> TensorView:
    """The view itself when contiguous; for numpy a contiguous copy; otherwise an error."""
    if tensor.is_contiguous:
        return tensor
    if tensor.kind == "numpy" and tensor.device == CPU:
        copy = np.ascontiguousarray(tensor.owner)
        return TensorView(copy.ctypes.data, tensor.shape, _compact_strides(tensor.shape),
                          tensor.dtype, CPU, 0, copy, "numpy")
    raise InvalidArgumentError(f"{name} must be contiguous (call .contiguous() on it first)")


def _compact_strides(shape) -> tuple:
    strides, running = [], 1
    for extent in reversed(shape):
        strides.append(running)
        running *= extent
    return tuple(reversed(strides))


_NUMPY_DTYPES = {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}


def empty_like_kind(like: TensorView | None, shape, dtype: DType, device: str, device_index: int):
    """Allocate an output of the same family as `like` (numpy, torch or CuPy)."""
    kind = like.kind if like is not None else "numpy"
    if device == CPU and kind != "torch":
        return np.empty(shape, dtype=_NUMPY_DTYPES[dtype])
    if kind == "torch":
        import torch  # only reached when the caller already uses torch
        torch_dtype = {DType.F32: torch.float32, DType.F16: torch.float16,
                       DType.BF16: torch.bfloat16}[dtype]
        torch_device = torch.device("cuda", device_index) if device == CUDA else torch.device("cpu")
        return torch.empty(shape, dtype=torch_dtype, device=torch_device)
    if kind == "cupy" and dtype != DType.BF16:
        import cupy
        with cupy.cuda.Device(device_index):
            return cupy.empty(shape, dtype=_NUMPY_DTYPES[dtype])
    raise InvalidArgumentError("cannot allocate the output for this kind of device tensor: pass out=")


def current_stream_of(obj, device_index: int) -> int | None:
    """The stream torch or CuPy would run work on for `obj` now; None for other producers."""
    kind = _kind_of(obj)
    if kind == "torch":
        import torch
        return int(torch.cuda.current_stream(device_index).cuda_stream)
    if kind == "cupy":
        import cupy
        return int(cupy.cuda.get_current_stream().ptr)
    return None


def resolve_stream(stream, tensors) -> int:
    """A cudaStream_t as int: the given one, or the current stream of torch/CuPy inputs."""
    if stream is None:
        for tensor in tensors:
            if tensor is not None and tensor.device == CUDA:
                current = current_stream_of(tensor.owner[0] if isinstance(tensor.owner, tuple)
                                            else tensor.owner, tensor.device_index)
                if current is not None:
                    return current
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr", "handle"):  # torch, CuPy, others
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise InvalidArgumentError(f"cannot read a CUDA stream handle from {type(stream).__name__}")
