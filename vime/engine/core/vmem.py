"""Device memory at fixed addresses: the CUDA driver's virtual memory management through ctypes.

A colocated trainer steps on the engine's GPU while the engine has given its memory back
(`LLMEngine.release_memory`). Freeing tensors and allocating new ones would move the weights and
the KV pools, leaving every captured CUDA graph pointing at dead storage (re-capturing costs
seconds). Here an address range is reserved once (`cuMemAddressReserve`) and physical memory is
mapped into it (`cuMemCreate` + `cuMemMap`) and unmapped again (`cuMemUnmap`): the memory goes
back to the device, the addresses stay, and the graphs stay valid.

libcuda is loaded on first use, so this module imports anywhere (CPU-only torch included).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_ushort, c_void_p
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)

# from cuda.h
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEMHOSTREGISTER_PORTABLE = 1

PARAM_ALIGNMENT = 256  # each packed parameter starts as aligned as a cudaMalloc'd tensor would


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", c_ubyte),
        ("gpuDirectRDMACapable", c_ubyte),
        ("usage", c_ushort),
        ("reserved", c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


# Every function used, with its arguments; all return a CUresult. The _v2 names are what cuda.h
# maps the plain names to.
_SIGNATURES: dict[str, list] = {
    "cuInit": [c_uint],
    "cuGetErrorName": [c_int, POINTER(c_char_p)],
    "cuGetErrorString": [c_int, POINTER(c_char_p)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetAttribute": [POINTER(c_int), c_int, c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuCtxPushCurrent_v2": [c_void_p],
    "cuCtxPopCurrent_v2": [POINTER(c_void_p)],
    "cuCtxSynchronize": [],
    "cuMemGetAllocationGranularity": [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int],
    "cuMemAddressReserve": [POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemAddressFree": [c_uint64, c_size_t],
    "cuMemCreate": [POINTER(c_uint64), c_size_t, POINTER(CUmemAllocationProp), c_uint64],
    "cuMemRelease": [c_uint64],
    "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemUnmap": [c_uint64, c_size_t],
    "cuMemSetAccess": [c_uint64, c_size_t, POINTER(CUmemAccessDesc), c_size_t],
    "cuMemHostRegister_v2": [c_void_p, c_size_t, c_uint],
    "cuMemHostUnregister": [c_void_p],
}


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, c_int
    result = lib.cuInit(0)  # torch has initialized the driver already; this makes it so in any case
    if result:
        raise CudaDriverError(f"cuInit failed with CUresult {result}")
    return lib


def _call(name: str, *args: object) -> None:
    result = getattr(_driver(), name)(*args)
    if result:
        raise CudaDriverError(f"{name} failed: {_describe(result)}")


def _describe(result: int) -> str:
    name, text = c_char_p(), c_char_p()
    _driver().cuGetErrorName(result, byref(name))
    _driver().cuGetErrorString(result, byref(text))
    return f"{(text.value or b'unknown error').decode()} ({(name.value or b'?').decode()}, CUresult {result})"


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _primary_context(ordinal: int) -> c_void_p:
    """Torch's context on the device (the primary one); retained for the life of the process."""
    dev, ctx = c_int(), c_void_p()
    _call("cuDeviceGet", byref(dev), ordinal)
    _call("cuDevicePrimaryCtxRetain", byref(ctx), dev)
    return ctx


@contextmanager
def _current(ordinal: int) -> Iterator[None]:
    """The device's primary context current on this thread for the calls inside: the engine may
    be driven from a thread (the server's) that has not made a CUDA call yet."""
    _call("cuCtxPushCurrent_v2", _primary_context(ordinal))
    try:
        yield
    finally:
        _call("cuCtxPopCurrent_v2", byref(c_void_p()))


def _location(ordinal: int) -> CUmemLocation:
    return CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)


def _allocation_prop(ordinal: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _location(ordinal)
    return prop


@functools.cache
def _granularity(ordinal: int) -> int:
    size = c_size_t()
    with _current(ordinal):
        _call(
            "cuMemGetAllocationGranularity",
            byref(size),
            byref(_allocation_prop(ordinal)),
            CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    return size.value


def supported(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU whose driver maps memory at reserved addresses. Where not
    (CPU, another platform, an old driver), the engine frees and reallocates as it always did."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    value, dev = c_int(), c_int()
    try:
        _call("cuDeviceGet", byref(dev), _ordinal(device))
        _call("cuDeviceGetAttribute", byref(value), CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
        reason = "the device does not support it"
    except (OSError, AttributeError, CudaDriverError) as e:  # no libcuda, a driver without VMM calls, no device
        reason = str(e)
    if value.value:
        return True
    log.warning(
        "CUDA virtual memory management is unavailable (%s): a memory release moves the engine's storage", reason
    )
    return False


@dataclass(eq=False)
class VirtualBuffer:
    """`size` bytes of device memory at an address that stays the buffer's for its whole life.

    Created reserved and mapped. `unmap` gives the physical memory back to the device and keeps
    the addresses; `map` puts fresh memory (contents undefined) behind the same addresses, so
    pointers taken earlier, such as a CUDA graph's, are valid again. Touching the memory while
    unmapped is an illegal address, a fatal CUDA error: owners drop or re-point their tensors
    first. Tensors from `tensor()` keep the buffer alive; once the last is gone, the memory and
    the addresses are freed.
    """

    size: int
    device: torch.device
    address: int = field(init=False, default=0)
    reserved: int = field(init=False, default=0)  # size rounded up to the allocation granularity
    mapped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.device = torch.device("cuda", _ordinal(self.device))
        granularity = _granularity(self.device.index)
        reserved = -(-self.size // granularity) * granularity
        ptr = c_uint64()
        with _current(self.device.index):
            _call("cuMemAddressReserve", byref(ptr), reserved, 0, 0, 0)
        self.address, self.reserved = ptr.value, reserved
        self.map()

    def map(self) -> None:
        """Back the addresses with fresh device memory (no-op when mapped)."""
        if self.mapped:
            return
        ordinal = self.device.index
        handle = c_uint64()
        try:
            with _current(ordinal):
                _call("cuMemCreate", byref(handle), self.reserved, byref(_allocation_prop(ordinal)), 0)
                try:
                    _call("cuMemMap", self.address, self.reserved, 0, handle, 0)
                finally:
                    _call("cuMemRelease", handle)  # the mapping holds the memory now: unmapping frees it
                try:
                    access = CUmemAccessDesc(_location(ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                    _call("cuMemSetAccess", self.address, self.reserved, byref(access), 1)
                except CudaDriverError:
                    _call("cuMemUnmap", self.address, self.reserved)
                    raise
        except CudaDriverError as e:
            raise CudaDriverError(f"mapping {self.reserved / 2**30:.2f} GiB on {self.device}: {e}") from None
        self.mapped = True

    def unmap(self) -> None:
        """Give the physical memory back to the device, once all queued work is done with it
        (no-op when unmapped). The addresses stay reserved for `map`."""
        if not self.mapped:
            return
        with _current(self.device.index):
            _call("cuCtxSynchronize")
            _call("cuMemUnmap", self.address, self.reserved)
        self.mapped = False

    def tensor(self) -> torch.Tensor:
        """The buffer as a uint8 CUDA tensor of `size` elements, no copy (mapped buffers only:
        torch asks the driver which device the pointer is on)."""
        assert self.mapped, "the buffer is unmapped"
        return torch.as_tensor(_CudaArray(self), device=self.device)

    def __del__(self) -> None:
        if not self.address or sys.is_finalizing():  # at exit, the process gives everything back
            return
        self.unmap()
        with _current(self.device.index):
            _call("cuMemAddressFree", self.address, self.reserved)


class _CudaArray:
    """A buffer as `__cuda_array_interface__` (version 3) for `torch.as_tensor`. The tensor's
    storage holds this object, and through it the buffer."""

    def __init__(self, buffer: VirtualBuffer):
        self.buffer = buffer
        self.__cuda_array_interface__ = {
            "shape": (buffer.size,),
            "typestr": "|u1",
            "data": (buffer.address, False),
            "strides": None,
            "version": 3,
        }


def pinned_host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of page-locked host memory as a uint8 CPU tensor; unpinned and freed with it.

    Paged in by torch's multi-threaded fill, then registered with the driver: 1.0 s for 8 GiB on
    the H200 host, where cuMemHostAlloc took 5.3 s and torch's pinned allocator 4.5 s (which may
    also round up to a power of two and keeps freed blocks cached)."""
    ordinal = _ordinal(device)
    memory = torch.empty(nbytes, dtype=torch.uint8)
    memory.zero_()
    with _current(ordinal):
        _call("cuMemHostRegister_v2", memory.data_ptr(), nbytes, CU_MEMHOSTREGISTER_PORTABLE)
    array = (c_ubyte * nbytes).from_address(memory.data_ptr())
    weakref.finalize(array, _unregister, memory, ordinal).atexit = False  # keeps `memory` until then
    return torch.frombuffer(array, dtype=torch.uint8)  # keeps `array` until the tensor goes


def _unregister(memory: torch.Tensor, ordinal: int) -> None:
    with _current(ordinal):
        _call("cuMemHostUnregister", memory.data_ptr())


class PackedWeights:
    """A model's parameters as aligned slices of one VirtualBuffer, so that the weights leave the
    device in one copy and come back to the same addresses.

    `release` copies the buffer into one pinned host buffer (made at the first release, reused
    after), points every parameter at its host slice and unmaps: a weight update that arrives
    while released lands in the host copy and comes back with it. `restore` maps the buffer again,
    copies the host buffer in, and points the parameters at the device slices they had: CUDA
    graphs captured before the release stay valid.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        """Give a model built on the meta device its parameters, uninitialized, before loading.
        A meta tensor's `.data` cannot be set to a device one, so every Parameter is replaced by
        one over its slice; tied embeddings, one Parameter in two modules, stay one."""
        meta = list(model.parameters())  # each Parameter once
        if not all(p.is_meta for p in meta):
            raise ValueError("PackedWeights packs a model built on the meta device, before its weights are loaded")
        self.offsets: list[int] = []
        end = 0
        for p in meta:
            self.offsets.append(end)
            end += -(-p.numel() * p.element_size() // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        self.buffer = VirtualBuffer(end, device)
        self.flat = self.buffer.tensor()
        self.device_views = [self._view(self.flat, o, p) for p, o in zip(meta, self.offsets)]
        packed = {id(p): nn.Parameter(v, requires_grad=False) for p, v in zip(meta, self.device_views)}
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, packed[id(p)])
        self.params = list(packed.values())
        self.host: torch.Tensor | None = None
        self.host_views: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return self.buffer.size

    @property
    def released(self) -> bool:
        return not self.buffer.mapped

    def release(self) -> None:
        if self.released:
            return
        if self.host is None:
            self.host = pinned_host_buffer(self.nbytes, self.buffer.device)
            self.host_views = [self._view(self.host, o, p) for p, o in zip(self.params, self.offsets)]
        self.host.copy_(self.flat)
        self._point(self.host_views)
        self.buffer.unmap()

    def restore(self) -> None:
        if not self.released:
            return
        assert self.host is not None
        self.buffer.map()
        self.flat.copy_(self.host, non_blocking=True)
        # done before anyone may write the host copy again (an update during the next release)
        torch.cuda.synchronize(self.buffer.device)
        self._point(self.device_views)

    @staticmethod
    def _view(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
        return flat[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    def _point(self, views: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, views):
            p.data = v
