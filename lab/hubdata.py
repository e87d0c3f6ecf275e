"""A synthetic model repo, the same bytes every time, for the lab's hub.

Real file names of a Hugging Face checkpoint (config, tokenizer, safetensors);
the safetensors file is a valid one holding a single tensor of ``size_mib``
(4 MiB by default; the first-deploy benchmark asks for GBs). Large files live
on disk (written once, hashed as they are written), small ones in memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DEFAULT_MIB = 4
BLOCK = 1024 * 1024
# the hub answers each request in a thread of its own: the first requests of a fresh cache
# (two hosts asking at once) must not write the same checkpoint side by side, nor read one
# another is still writing (a host got a corrupt blob, another an empty reply)
_WRITING = threading.Lock()


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str
    git_oid: str
    lfs: bool
    data: bytes | None = None  # small files
    disk: str | None = None  # large ones

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def chunks(self, start: int, end: int):
        """The bytes ``start..end`` (inclusive), in pieces."""
        if self.data is not None:
            yield self.data[start:end + 1]
            return
        with open(self.disk, "rb") as handle:
            handle.seek(start)
            left = end + 1 - start
            while left > 0:
                piece = handle.read(min(BLOCK, left))
                if not piece:
                    return
                left -= len(piece)
                yield piece


def _small(path: str, data: bytes, lfs: bool) -> RepoFile:
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return RepoFile(path, len(data), hashlib.sha256(data).hexdigest(), oid, lfs, data=data)


def _safetensors(repo: str, size_mib: int, where: Path) -> RepoFile:
    """A valid safetensors file of about ``size_mib`` MiB, on disk under ``where``."""
    n = size_mib * 1024 * 1024 // 2
    header = json.dumps({"__metadata__": {"format": "pt", "source": "dgemma-lab synthetic"},
                         "lm_head.weight": {"dtype": "F16", "shape": [n // 1024, 1024],
                                            "data_offsets": [0, n * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    head = struct.pack("<Q", len(header)) + header
    seed = hashlib.sha256(repo.encode()).digest()
    block = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(BLOCK // 32))
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{hashlib.sha1(repo.encode()).hexdigest()[:16]}-{size_mib}.safetensors"
    record = path.with_suffix(".sums")
    with _WRITING:
        if not (path.exists() and record.exists()):
            _write_safetensors(path, record, head, block, n)
    sha256, sha1 = record.read_text().split()
    return RepoFile("model.safetensors", path.stat().st_size, sha256, sha1, True, disk=str(path))


def _write_safetensors(path: Path, record: Path, head: bytes, block: bytes, n: int):
    sha256, sha1 = hashlib.sha256(), hashlib.sha1()
    sha1.update(b"blob %d\0" % (len(head) + n * 2))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        for piece in [head] + [block] * (n * 2 // BLOCK) + [block[:n * 2 % BLOCK]]:
            if piece:
                handle.write(piece)
                sha256.update(piece)
                sha1.update(piece)
    os.replace(tmp, path)
    record.write_text(f"{sha256.hexdigest()} {sha1.hexdigest()}\n")


@lru_cache(maxsize=None)
def repo_files(repo: str, size_mib: int = DEFAULT_MIB, where: str = "/var/cache/dgemma-lab/hub") -> tuple:
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "torch_dtype": "bfloat16", "diffusion_canvas_length": 256, "_name_or_path": repo,
              "_note": "synthetic lab checkpoint: the real one is 18-49 GB"}
    return (
        _small(".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False),
        _small("README.md", f"# {repo} (dgemma lab)\n\nA synthetic stand-in of the real checkpoint.\n".encode(), False),
        _small("config.json", json.dumps(config, indent=2).encode() + b"\n", False),
        _small("generation_config.json", b'{"max_new_tokens": 256, "do_sample": false}\n', False),
        _small("tokenizer_config.json", b'{"model_max_length": 262144, "tokenizer_class": "GemmaTokenizer"}\n',
               False),
        _small("tokenizer.json", json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"<pad>": 0}}})
               .encode(), True),
        _safetensors(repo, size_mib, Path(where)),
    )


@lru_cache(maxsize=None)
def commit(repo: str, size_mib: int = DEFAULT_MIB, where: str = "/var/cache/dgemma-lab/hub") -> str:
    digest = hashlib.sha1(repo.encode())
    for f in repo_files(repo, size_mib, where):
        digest.update(f.path.encode() + f.etag.encode())
    return digest.hexdigest()
