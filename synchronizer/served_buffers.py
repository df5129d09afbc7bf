"""The buffers downloads are served from: each fragment's safetensors bytes in a float dtype
(`encode`) or as quantized codes (`encode_codes`, served_versions.py's encodings), encoded into
buffers that are reused once no download holds them.

    served = Served("bfloat16", fragments=4)
    view = served.encode(p, fs.params)     # a memoryview of the whole payload
    view, outs = served.allot(p, entries, meta)  # or a header, and views to write into
    ...                                     # install it; the one it replaces:
    served.retire(p, old_view)              # reused by a later encode once nobody reads it

The header is laid out first and each tensor converted straight into its place in the
payload (one pass, torch's copy, the GIL released), in the buffer of a superseded version
when one is idle: a converted copy joined into a fresh payload would be two new allocations
of the payload's size whose every page faults on first touch, which costs a merge more than
the outer step's arithmetic (bench/RESULTS.md, "Figures behind the code").

A retired buffer is idle when nothing but this object refers to it: a download that took
the view (`Synchronizer.fragment`) keeps a reference until its response is sent, and every
memoryview over the buffer holds one, so a buffer still being read is never written.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch

from ddiloco.synchronizer import parallel_passes
from ddiloco.wire import codec, encodings
from ddiloco.wire.quant import Quantized

__all__ = ["Served"]

KEEP = 2
"""Retired buffers kept per fragment and payload kind (a slow download holds one; the next
merge takes the other). A delta encoding serves two kinds per version (served_versions.py)."""


class Served:
    """Encodes fragments in `dtype` into recycled buffers; thread-safe."""

    def __init__(self, dtype: str, fragments: int = 0, ways: int = 1, kinds: int = 1) -> None:
        self.dtype = codec.WIRE_DTYPES[dtype]
        self.keep = KEEP * kinds
        """Retired buffers kept per fragment: `KEEP` per kind of payload a version serves."""
        self.ways = ways
        """Pieces a large tensor's conversion is split into (parallel_passes.py)."""
        self.spares: list[list[bytearray]] = [[] for _ in range(fragments)]
        self.lock = threading.Lock()
        self.reused = 0
        """Encodes that found an idle buffer (tests and the bench read it)."""

    def encode(
        self, p: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> memoryview:
        """The safetensors payload of `tensors` in the broadcast dtype."""
        entries = [(name, self.dtype, tuple(tensors[name].shape)) for name in sorted(tensors)]
        return self._payload(
            p,
            entries,
            metadata,
            lambda name, out: parallel_passes.copy_(out, tensors[name], self.ways),
        )  # in pieces (parallel_passes.py)

    def encode_codes(
        self, p: int, codes: dict[str, Quantized], metadata: dict[str, str] | None = None
    ) -> memoryview:
        """The payload of quantized tensors (served_versions.py): each `name`'s codes, flat, and
        its scales as `name#scales` (encodings.py's layout), into a recycled buffer too."""
        parts: dict[str, torch.Tensor] = {}
        for name, q in codes.items():
            parts[name] = q.codes
            parts[name + encodings.SCALES_SUFFIX] = q.scales
        entries = [(name, parts[name].dtype, tuple(parts[name].shape)) for name in sorted(parts)]
        return self._payload(
            p, entries, metadata, lambda name, out: out.copy_(parts[name].reshape(-1))
        )

    def _payload(
        self,
        p: int,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None,
        fill: Callable[[str, torch.Tensor], object],
    ) -> memoryview:
        """A safetensors payload of `entries` in an idle buffer of fragment p (or a new one):
        the header, then `fill(name, out)` writes each tensor into its flat view `out`."""
        view, outs = self.allot(p, entries, metadata)
        for name, out in outs.items():
            if out.numel():
                fill(name, out)
        del outs
        return view

    def allot(
        self,
        p: int,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None,
    ) -> tuple[memoryview, dict[str, torch.Tensor]]:
        """A safetensors payload of `entries` (name, dtype, shape) in an idle buffer of
        fragment p (or a new one), its header written, and each tensor's flat view in it for
        the caller to write (an empty tensor of its own where it has no values). A view keeps
        the buffer from being reused while it lives; `retire` gives back a payload the caller
        does not serve."""
        head, offsets = codec.header_bytes(entries, metadata)
        size = len(head) + (offsets[-1][1] if offsets else 0)
        buf = self._idle(p, size)
        if buf is None:
            buf = bytearray(size)
        else:
            self.reused += 1
        buf[: len(head)] = head
        outs: dict[str, torch.Tensor] = {}
        for (name, dtype, _), (begin, end) in zip(entries, offsets, strict=True):
            if end > begin:
                outs[name] = torch.frombuffer(
                    buf, dtype=dtype, count=(end - begin) // dtype.itemsize,
                    offset=len(head) + begin,
                )  # fmt: skip
            else:
                outs[name] = torch.empty(0, dtype=dtype)
        return memoryview(buf), outs

    def prime(self, p: int, tensors: dict[str, torch.Tensor]) -> int:
        """Give fragment p `KEEP` idle buffers of its payload's size, every page touched,
        so its first merges encode into them (prefault.py); returns how many."""
        entries = [(name, self.dtype, tuple(tensors[name].shape)) for name in sorted(tensors)]
        head, offsets = codec.header_bytes(entries, None)
        size = len(head) + (offsets[-1][1] if offsets else 0)
        if p >= len(self.spares):
            return 0
        with self.lock:
            want = KEEP - sum(len(b) == size for b in self.spares[p])
        for _ in range(want):
            buf = bytearray(size)
            torch.frombuffer(buf, dtype=torch.uint8).fill_(0)  # calloc's pages: touch them
            with self.lock:
                self.spares[p].append(buf)
                del self.spares[p][: -self.keep]
        return max(0, want)

    def retire(self, p: int, view: memoryview | bytes) -> None:
        """`view` (an `encode` result) is no longer served: its buffer may be reused once
        nothing reads it."""
        buf = view.obj if isinstance(view, memoryview) else None
        if not isinstance(buf, bytearray) or p >= len(self.spares):
            return
        with self.lock:
            spares = self.spares[p]
            spares.append(buf)
            del spares[: -self.keep]

    def _idle(self, p: int, size: int) -> bytearray | None:
        with self.lock:
            if p >= len(self.spares):
                return None
            spares = self.spares[p]
            for i in range(len(spares)):
                # references: the list's, and getrefcount's argument; any other is a reader
                if len(spares[i]) == size and sys.getrefcount(spares[i]) == 2:
                    return spares.pop(i)
        return None
