"""Weights outside the process image: a vLLM worker extension that saves, releases and loads
each rank's weights *as the engine laid them out*.

Loaded into every vLLM worker with ``--worker-extension-cls
warmctl.engine.worker_ext.WeightsExtension`` (vLLM 0.32 ``WorkerWrapperBase`` adds the class
as a base of the worker class; its methods are then callable through ``collective_rpc``,
over HTTP at ``POST /collective_rpc`` when the server runs with ``VLLM_SERVER_DEV_MODE=1``).
:func:`warmctl.engine.sleep.SleepClient.save_weights` and ``load_weights`` are the callers.

What "as laid out" means: the tensors of ``model.named_parameters()`` after vLLM's loading and
post-processing (``process_weights_after_loading``): sharded for this rank's tensor/expert
parallel slice, fused (qkv, gate-up), quantised or repacked, in the engine's dtype. Restoring
them needs no checkpoint-format conversion and no re-sharding: each tensor is copied back into
the parameter it came from. Buffers (rotary caches and the like) stay in the process image, as
vLLM's own sleep level 2 keeps them.

Weights the engine computes with *outside* its parameters cannot be taken out, and saving then
refuses (:func:`outside_parameters`) instead of leaving them silently in the image.
The case known: vLLM's CPU build (``process_weights_after_loading`` of unquantized linear
layers, ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``) hands each linear
weight to a GEMM library that keeps its own packed copy -- oneDNN (``create_onednn_mm``: on
AVX-512 hosts for bfloat16, and for float32 weights on any x86 host), sgl-kernel
(``convert_weight_packed``, AMX hosts) or zentorch (AMD Zen) -- and replaces the parameter by an
empty one; the layer then calls ``layer.cpu_linear``. On an AVX2 host oneDNN refuses bfloat16
("could not create a primitive descriptor", in the engine log) and vLLM falls back to
``torch.nn.functional.linear`` on the parameter, which is why the weights are parameters there.
The packed copies live in the library's own memory (no tensor to save or refill), so such an
engine can only be snapshotted with the weights in its image (``weights_outside_image = false``).

File format: one `safetensors <https://github.com/huggingface/safetensors>`_ file per rank,
``rank-<global rank>.safetensors``, tensors sorted by name, ``__metadata__`` holding
``{"format": "pt", "warmctl": "weights/1", "rank": "<r>"}``. The writer streams (one tensor in
host memory at a time: a rank's weights are tens of GiB on a GPU host) and is deterministic, so
two snapshots of the same model on the same layout produce identical bytes and share every
store chunk. Loading reads the header and then the bytes straight into each parameter; the
tests check the files with the ``safetensors`` library itself.

This module is imported inside the engine's worker processes: it imports only torch (a vLLM
dependency) and the standard library, never the rest of warmctl.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
from pathlib import Path

import torch

#: torch dtype -> safetensors dtype name (safetensors' format spec, "dtype" field).
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
FORMAT_TAG = "weights/1"
#: Bytes staged through host memory at a time when writing (bounds the writer's memory).
STAGE_BYTES = 64 << 20


def rank_file(directory: str | Path, rank: int) -> Path:
    """``<directory>/rank-<rank>.safetensors``."""
    return Path(directory) / f"rank-{rank}.safetensors"


def _stored(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that carry bytes, sorted by name (removed/placeholder ones are empty)."""
    return sorted(((n, p) for n, p in model.named_parameters() if p.numel() > 0), key=lambda x: x[0])


#: a tensor held as a plain module attribute (not a parameter or buffer) whose name says
#: ``weight`` and that is at least this large counts as weights outside the parameters (small
#: ones are scales and flags; other large ones are state, e.g. each attention layer's
#: ``kv_cache``, which belongs in the image)
ATTR_TENSOR_MIN_BYTES = 1 << 20


def outside_parameters(model: torch.nn.Module) -> list[str]:
    """What ``model`` computes with that ``named_parameters()`` does not hold, one description per
    module: a ``weight`` parameter emptied while the module computes through ``cpu_linear``
    (vLLM's CPU GEMM dispatch packed it into oneDNN/sgl/zentorch memory; module doc), and tensors
    of at least :data:`ATTR_TENSOR_MIN_BYTES` kept as plain attributes named ``*weight*`` (e.g.
    vLLM's ``_cpu_unpacked_conv_weight``). Empty when every weight is a parameter."""
    found = []
    for name, m in model.named_modules():
        w = m._parameters.get("weight")
        if w is not None and w.numel() == 0 and callable(getattr(m, "cpu_linear", None)):
            found.append(f"{name}: weight packed by vLLM's CPU GEMM dispatch, parameter emptied")
        for k, v in vars(m).items():
            if ("weight" in k and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
                    and v.numel() * v.element_size() >= ATTR_TENSOR_MIN_BYTES):
                found.append(f"{name}.{k}: a {v.numel() * v.element_size() / 2**20:.1f} MiB tensor held as an attribute")
    return found


def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """Write ``tensors`` (name, tensor on any device) to ``path`` in safetensors format,
    streaming through one host buffer of at most :data:`STAGE_BYTES`; returns the file size
    in bytes. The tensors' own storage is never exported (``Tensor.numpy()`` would make it
    non-resizable, and :meth:`WeightsExtension.warmctl_release_weights` resizes it).

    Written to ``path.tmp`` then renamed (a crash never leaves a truncated file under the
    final name). Raises ValueError for a dtype safetensors cannot express, OSError on I/O.
    """
    path = Path(path)
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    off = 0
    for name, t in tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    stage = bytearray(min(STAGE_BYTES, max((t.numel() * t.element_size() for _, t in tensors), default=0)) or 1)
    staged = torch.frombuffer(stage, dtype=torch.uint8)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for _, t in tensors:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), len(stage)):
                n = min(len(stage), flat.numel() - start)
                staged[:n].copy_(flat[start:start + n])  # device -> host, or host -> host
                f.write(memoryview(stage)[:n])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(hdr) + off


class WeightsExtension:
    """Worker methods (called on every rank through ``collective_rpc``; arguments are strings).

    Each returns a JSON-able dict: ``rank``, ``path``, ``bytes`` (tensor bytes), ``tensors``
    (count), ``seconds`` (wall time in this worker). Errors raise RuntimeError with the rank,
    the tensor name and what differs; vLLM returns them to the caller as the RPC's failure.
    """

    def _wc_model(self) -> torch.nn.Module:
        return self.get_model()  # type: ignore[attr-defined]  # vLLM Worker.get_model

    def _wc_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def warmctl_save_weights(self, directory: str) -> dict:
        """Write this rank's parameters to ``rank-<rank>.safetensors`` in ``directory``.

        When the engine computes with weights outside its parameters (:func:`outside_parameters`:
        they would stay in the process image) nothing is written and the answer is
        ``{"rank", "refused": why, "outside": [descriptions]}`` instead (a dict, not an exception:
        vLLM reports a worker's exception to the HTTP caller only as an internal error)."""
        t0 = time.monotonic()
        rank = self._wc_rank()
        model = self._wc_model()
        outside = outside_parameters(model)
        if outside:
            return {"rank": rank, "outside": outside[:20], "refused": (
                f"weights_outside_image refused: {len(outside)} module(s) of rank {rank} compute with weights outside "
                "the parameters, which would stay in the process image (vLLM's CPU build packs linear weights into "
                "oneDNN memory on AVX-512 hosts and for float32 weights; e.g. " + "; ".join(outside[:2]) + "); "
                "set [checkpoint] weights_outside_image = false in the profile for this kind of host")}
        params = _stored(model)
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = rank_file(directory, rank)
        write_safetensors(path, params, {"format": "pt", "warmctl": FORMAT_TAG, "rank": str(rank)})
        return {"rank": rank, "path": str(path), "tensors": len(params),
                "bytes": sum(p.numel() * p.element_size() for _, p in params),
                "seconds": time.monotonic() - t0}

    def warmctl_release_weights(self) -> dict:
        """Zero every parameter and free its storage, so that neither the bytes nor the pages
        are in a checkpoint taken now (shapes, strides and parameter objects stay; only
        :meth:`warmctl_load_weights` makes the engine usable again). For engines without
        sleep mode (the CPU build); on GPUs vLLM's sleep level 2 does this. A storage that cannot
        be resized (exported to numpy, say) is only zeroed: ``zeroed_only_bytes`` counts those
        (zero pages cost nothing in the store, but the image keeps their size)."""
        t0 = time.monotonic()
        params = _stored(self._wc_model())
        freed = 0
        zeroed_only = 0
        for _, p in params:
            st = p.data.untyped_storage()
            if st.nbytes() == 0:
                continue
            p.data.zero_()
            if st.resizable():
                freed += st.nbytes()
                st.resize_(0)
            else:  # storage shared with something that pinned it: its pages stay, as zeros
                zeroed_only += st.nbytes()
        return {"rank": self._wc_rank(), "tensors": len(params), "bytes": freed, "zeroed_only_bytes": zeroed_only,
                "seconds": time.monotonic() - t0}

    def warmctl_load_weights(self, directory: str) -> dict:
        """Copy every tensor of ``rank-<rank>.safetensors`` back into its parameter, in place
        (storage re-allocated first if :meth:`warmctl_release_weights` freed it). The file
        must hold exactly this rank's parameters with the same dtypes and shapes.

        Host-memory parameters are read straight from the file into their storage (one copy
        from the page cache); device parameters go through one staging buffer (pinned when
        CUDA is there) of at most :data:`STAGE_BYTES`. Non-contiguous parameters (strided
        views) are read whole into a host tensor of their shape and copied into their strides."""
        t0 = time.monotonic()
        rank = self._wc_rank()
        path = rank_file(directory, rank)
        if not path.is_file():
            raise RuntimeError(f"rank {rank}: weights file {path} does not exist")
        params = dict(_stored(self._wc_model()))
        entries, data_start = read_header(path)
        if set(entries) != set(params):
            missing, extra = sorted(set(params) - set(entries)), sorted(set(entries) - set(params))
            raise RuntimeError(f"rank {rank}: {path} does not match the engine's parameters "
                               f"(missing {missing[:5]}, unexpected {extra[:5]})")
        for name, e in entries.items():
            p = params[name]
            if e["dtype"] != DTYPES.get(p.dtype) or e["shape"] != list(p.shape):
                raise RuntimeError(f"rank {rank}: {name} in {path} is {e['dtype']} {tuple(e['shape'])}, "
                                   f"the engine has {DTYPES.get(p.dtype, p.dtype)} {tuple(p.shape)}")
        nbytes = 0
        stage = None
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for name, e in sorted(entries.items(), key=lambda x: x[1]["data_offsets"][0]):
                p = params[name]
                begin, end = e["data_offsets"]
                st = p.data.untyped_storage()
                need = _storage_extent(p)
                if st.nbytes() < need:
                    st.resize_(need)
                if p.device.type == "cpu" and p.is_contiguous():
                    _read_into(fd, p.data_ptr(), end - begin, data_start + begin, path)
                elif not p.is_contiguous():
                    # A strided parameter (a transposed or sliced view) has no flat byte view;
                    # the file holds its elements in row-major order of its shape (the writer
                    # makes them contiguous). Read them into one host tensor of that shape and
                    # let copy_ scatter them into the parameter's strides (host memory: the
                    # tensor's size, once).
                    host = torch.empty(tuple(p.shape), dtype=p.dtype,
                                       pin_memory=p.device.type == "cuda" and torch.cuda.is_available())
                    _read_into(fd, host.data_ptr(), end - begin, data_start + begin, path)
                    p.data.copy_(host)
                else:
                    if stage is None:
                        stage = torch.empty(min(STAGE_BYTES, max(x["data_offsets"][1] - x["data_offsets"][0] for x in entries.values())),
                                            dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                    flat = p.data.view(-1).view(torch.uint8)
                    for s in range(0, end - begin, stage.numel()):
                        k = min(stage.numel(), end - begin - s)
                        _read_into(fd, stage.data_ptr(), k, data_start + begin + s, path)
                        flat[s:s + k].copy_(stage[:k])
                nbytes += end - begin
        finally:
            os.close(fd)
        if torch.cuda.is_available() and any(p.is_cuda for p in params.values()):
            torch.cuda.synchronize()
        return {"rank": rank, "path": str(path), "tensors": len(params), "bytes": nbytes,
                "seconds": time.monotonic() - t0}


def _storage_extent(t: torch.Tensor) -> int:
    """Bytes of storage ``t`` reaches: up to its last element through its strides (for a
    contiguous tensor ``(storage_offset + numel) * element_size``)."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """The safetensors header of ``path``: ({name: {"dtype", "shape", "data_offsets"}}, byte
    offset where the data section starts). Raises RuntimeError when the header is malformed or
    an entry lies outside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise RuntimeError(f"{path} is not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise RuntimeError(f"{path}: malformed safetensors header: {e}") from None
    header.pop("__metadata__", None)
    for name, e in header.items():
        b, end = e.get("data_offsets", (0, -1))
        if not 0 <= b <= end or 8 + n + end > size:
            raise RuntimeError(f"{path}: {name} lies outside the file (offsets {b}..{end}, file {size} bytes)")
    return header, 8 + n


def _read_into(fd: int, addr: int, n: int, offset: int, path: Path) -> None:
    """Read ``n`` bytes at ``offset`` of ``fd`` into host memory at ``addr``."""
    done = 0
    while done < n:
        buf = (ctypes.c_char * min(n - done, 1 << 30)).from_address(addr + done)
        got = os.preadv(fd, [buf], offset + done)
        if got <= 0:
            raise RuntimeError(f"{path} is truncated: wanted {n} bytes at {offset}, got {done}")
        done += got
