"""The decode's history programs as a CUDA kernel (``history.cu``), compiled at first use by NVRTC (the runtime
compiler that ships with PyTorch's CUDA builds: no toolkit needed) and launched through the driver API.

It computes what the Triton kernel's history programs compute (:func:`.triton._attend_codes`): per split of the
history, a normalised partial output and its log-sum-exp, written into the same rows for stage 2 to merge. The Triton
kernel stays the fallback and the CI-tested twin: :func:`unserved` says why this one does not run a call (it runs
CUDA sm_80+, one query token, per-token K and V of 2 or 4 bits with one fp16 scale and zero per token, head_dim
64/128/256, at most 8 query heads per KV head, no soft-capping), and ``tests/kernels/test_cuda.py`` compares both with
the torch twin on a GPU. It is chosen by ``DecodeConfig(history_kernel="cuda")`` in a call of ``decode``.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("history.cu")
WARPS = 4  # one-warp programs per block (they share nothing but the block's shared memory)
HEAD_DIMS = (64, 128, 256)
TILES = (32, 64)  # tokens per tile (DecodeConfig.block_n) that tests/kernels/test_cuda.py runs
MAX_GROUP = 8  # query heads per KV head: the MMA's N
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.cache
def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """(NVRTC, the CUDA driver) as PyTorch finds them, or None where either is missing."""
    try:
        from torch.cuda import _utils
    except ImportError:
        return None
    finder = getattr(_utils, "_get_gpu_rtc_library", None) or getattr(_utils, "_get_nvrtc_library", None)
    if finder is None or torch.version.cuda is None:
        return None
    try:
        return finder(), ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def available(device: torch.device) -> bool:
    """Whether the kernel can be built and run on ``device`` (CUDA sm_80+ with NVRTC and the driver)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
            and _libraries() is not None)


def _check(result: int, what: str) -> None:
    """RuntimeError naming the call ``what`` (``nvrtc...`` or a driver call) and its error where ``result`` is one."""
    if result == 0:
        return
    nvrtc, driver = _libraries()
    name = ctypes.c_char_p()
    if what.startswith("nvrtc"):
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        name.value = nvrtc.nvrtcGetErrorString(result)
    elif driver.cuGetErrorName(result, ctypes.byref(name)) != 0:
        name.value = None
    raise RuntimeError(f"{what} failed with {name.value.decode() if name.value else result}")


def stage_bytes(d: int, key_bits: int, value_bits: int, tile: int) -> int:
    """Shared memory of one pipeline stage: a tile's K and V codes and its four scale/zero vectors."""
    return tile * d * (key_bits + value_bits) // 8 + 8 * tile


@functools.cache
def _kernel(device_index: int, d: int, key_bits: int, value_bits: int, fp16: bool, tile: int, stages: int,
            has_mask: bool) -> tuple[ctypes.c_void_p, int]:
    """(CUfunction, dynamic shared memory bytes) of one configuration on one device, compiled once."""
    nvrtc, driver = _libraries()
    defines = {"D": d, "K_BITS": key_bits, "V_BITS": value_bits, "FP16": int(fp16), "TN": tile, "STAGES": stages,
               "HAS_MASK": int(has_mask), "WARPS": WARPS}
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE.read_text()
    major, minor = torch.cuda.get_device_capability(device_index)
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
    program = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"history.cu", 0, None, None),
           "nvrtcCreateProgram")
    try:
        result = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile history.cu ({defines}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # the device's primary context is current
        _check(driver.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        _check(driver.cuModuleGetFunction(ctypes.byref(function), module, b"oscar_history"), "cuModuleGetFunction")
        shared = block_shared_memory(d, key_bits, value_bits, tile, stages)
        _check(driver.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, shared), "cuFuncSetAttribute")
    return function, shared


@functools.cache
def compiled(device_index: int, d: int, key_bits: int, value_bits: int, fp16: bool, tile: int, stages: int,
             has_mask: bool) -> bool:
    """Whether :func:`_kernel` builds and loads this configuration on the device (tried once; a failure warns once
    and leaves the call to Triton's history programs)."""
    try:
        _kernel(device_index, d, key_bits, value_bits, fp16, tile, stages, has_mask)
    except RuntimeError as error:
        warnings.warn(f"the CUDA history kernel is unavailable here, Triton's history programs serve: {error}",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _aligned(t: torch.Tensor, dims: int = 2) -> bool:
    """16-byte aligned data and strides (in bytes) over the first ``dims`` dimensions, contiguous rows."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:dims])
            and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1])


def unserved(query: torch.Tensor, rotated_query: torch.Tensor, history: list[torch.Tensor], key_bits: int,
             value_bits: int, group: int, softcap: float | None, tile: int, stages: int) -> str | None:
    """None where the kernel serves the history programs of this call with ``tile``-token tiles over ``stages``
    stages, else what keeps it from it. It serves one query token in bf16/fp16 (q and q·R_K alike) on CUDA sm_80+,
    head_dim 64/128/256, at most 8 query heads per KV head, 2- or 4-bit K and V with one fp16 scale and zero per
    token, 16-byte aligned code rows and scale/zero blocks (a capacity of a multiple of 8 tokens), no soft-capping, a
    tile in TILES and a block's stages within the GPU's shared memory."""
    d, heads = query.shape[-1], history[0].shape[1]
    if query.shape[2] != 1:
        return "several query tokens"
    if query.dtype not in (torch.bfloat16, torch.float16) or rotated_query.dtype != query.dtype:
        return f"queries of {query.dtype} and {rotated_query.dtype}"
    if d not in HEAD_DIMS or group != d:
        return f"head_dim {d} with groups of {group} channels"
    if key_bits not in (2, 4) or value_bits not in (2, 4):
        return f"{key_bits}-bit K and {value_bits}-bit V"
    if query.shape[1] // heads > MAX_GROUP:
        return f"{query.shape[1] // heads} query heads per KV head"
    if softcap is not None:
        return "logit soft-capping"
    if any(t.dtype != torch.float16 or t.shape[-1] != 1 for t in history[1:3] + history[4:6]):
        return "scales and zeros other than one fp16 per token"
    if tile not in TILES or stages < 2:
        return f"tiles of {tile} tokens over {stages} stages"
    if not all(_aligned(t) for t in history) or history[0].shape[2] % 8:
        return "storage not 16-byte aligned"
    if not available(query.device):
        return f"{query.device} (needs CUDA sm_80+ and NVRTC)"
    if block_shared_memory(d, key_bits, value_bits, tile, stages) > _shared_memory_limit(query.device):
        return f"{stages} stages of {tile} tokens past a block's shared memory"
    return None


def _shared_memory_limit(device: torch.device) -> int:
    """A block's shared memory on ``device`` once its dynamic limit is raised (48 KiB where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


def block_shared_memory(d: int, key_bits: int, value_bits: int, tile: int, stages: int) -> int:
    """Bytes of shared memory of one block: each of its WARPS programs' ring of ``stages`` stages."""
    return WARPS * stages * stage_bytes(d, key_bits, value_bits, tile)


def history(rotated_query: torch.Tensor, history: list[torch.Tensor], mask: torch.Tensor | None, part_o: torch.Tensor,
            part_lse: torch.Tensor, counts: torch.Tensor, hist_splits: int, total_splits: int, qk_scale: float,
            key_bits: int, value_bits: int, tile: int, stages: int) -> None:
    """Launch the history programs (splits ``total − hist_splits`` onwards of ``part_o [B·Hq, total, D]`` and
    ``part_lse``) on the current stream.

    Args:
        rotated_query: ``q·R_K [B, Hq, 1, D]`` (contiguous last dimension), the storage's dtype.
        history: ``[K codes, K scale, K zero, V codes, V scale, V zero]`` (:attr:`PackedKV.history`; the codes as
            bytes or as halfword views of them).
        mask: the attention mask as bytes ``[B, 1, T]`` (nonzero = attend), or None.
        counts: int32 ``[4+]`` on the device (sink, history, recent, ring start).
        qk_scale: the logit scale times log2(e).
        tile, stages: tokens per tile (a multiple of 16) and pipeline stages per program.
    """
    batch, hq, _, d = rotated_query.shape
    heads = history[0].shape[1]
    programs = batch * heads * hist_splits
    function, shared = _kernel(rotated_query.device.index, d, key_bits, value_bits,
                               rotated_query.dtype == torch.float16, tile, stages, mask is not None)

    def byte_strides(t):
        return [ctypes.c_longlong(s * t.element_size()) for s in t.stride()[:2]]

    def element_strides(t):
        return [ctypes.c_longlong(s) for s in t.stride()[:2]]

    def pointer(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    mask_strides = (mask.stride(0), mask.stride(-1)) if mask is not None else (0, 0)
    args = [pointer(rotated_query), *element_strides(rotated_query), *map(pointer, history),
            *byte_strides(history[0]), *byte_strides(history[3]), *element_strides(history[1]),
            pointer(mask), *map(ctypes.c_longlong, mask_strides), pointer(part_o), pointer(part_lse), pointer(counts),
            ctypes.c_int(hist_splits), ctypes.c_int(total_splits - hist_splits), ctypes.c_int(total_splits),
            ctypes.c_int(heads), ctypes.c_int(hq // heads), ctypes.c_int(programs), ctypes.c_float(qk_scale)]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    stream = torch.cuda.current_stream(rotated_query.device).cuda_stream
    _, driver = _libraries()
    _check(driver.cuLaunchKernel(function, -(-programs // WARPS), 1, 1, 32 * WARPS, 1, 1, shared,
                                 ctypes.c_void_p(stream), params, None), "cuLaunchKernel")
