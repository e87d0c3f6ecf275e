"""A small synthetic model repo, the same bytes every time, for the lab's hub.

Real file names of a Hugging Face checkpoint (config, tokenizer, safetensors);
the safetensors file is a valid one holding a single few-MB tensor.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import lru_cache

SAFETENSORS_MIB = 4


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        """git's blob id (what the hub calls ``oid`` for small files)."""
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


def _safetensors(repo: str) -> bytes:
    n = SAFETENSORS_MIB * 1024 * 1024 // 2
    header = json.dumps({"__metadata__": {"format": "pt", "source": "dgemma-lab synthetic"},
                         "lm_head.weight": {"dtype": "F16", "shape": [n // 1024, 1024],
                                            "data_offsets": [0, n * 2]}}).encode()
    header += b" " * (-len(header) % 8)
    seed = hashlib.sha256(repo.encode()).digest()
    block = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(2048))
    body = (block * (n * 2 // len(block) + 1))[:n * 2]
    return struct.pack("<Q", len(header)) + header + body


@lru_cache(maxsize=None)
def repo_files(repo: str) -> tuple[RepoFile, ...]:
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "torch_dtype": "bfloat16", "diffusion_canvas_length": 256, "_name_or_path": repo,
              "_note": "synthetic lab checkpoint: the real one is 18-49 GB"}
    files = [
        RepoFile(".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False),
        RepoFile("README.md", f"# {repo} (dgemma lab)\n\nA synthetic stand-in of the real checkpoint.\n".encode(), False),
        RepoFile("config.json", json.dumps(config, indent=2).encode() + b"\n", False),
        RepoFile("generation_config.json", b'{"max_new_tokens": 256, "do_sample": false}\n', False),
        RepoFile("tokenizer_config.json", b'{"model_max_length": 262144, "tokenizer_class": "GemmaTokenizer"}\n', False),
        RepoFile("tokenizer.json", json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"<pad>": 0}}}).encode(), True),
        RepoFile("model.safetensors", _safetensors(repo), True),
    ]
    return tuple(files)


@lru_cache(maxsize=None)
def commit(repo: str) -> str:
    digest = hashlib.sha1(repo.encode())
    for f in repo_files(repo):
        digest.update(f.path.encode() + f.etag.encode())
    return digest.hexdigest()
