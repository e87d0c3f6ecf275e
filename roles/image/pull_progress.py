"""How far an image pull has come, read from the runtime's own lines.

Off a terminal neither runtime prints bytes, only layers: podman says
``Copying blob <digest>`` as each starts (``... skipped: already exists`` or
``... done`` when it knows) and ``Copying config`` once every blob is in;
docker says ``<id>: Pulling fs layer`` ... ``<id>: Pull complete`` (or
``Already exists``). The display shows layers done of layers seen.
"""
from __future__ import annotations

import re

from converge.changes import Transfer

PODMAN_BLOB = re.compile(r"Copying blob (?:sha256:)?([0-9a-f]{12,64})(.*)$")
DOCKER_LAYER = re.compile(r"([0-9a-f]{12}): (Pulling fs layer|Waiting|Downloading|Verifying Checksum|"
                          r"Download complete|Extracting|Pull complete|Already exists)\b")
DONE = ("done", "skipped", "already exists")


def pull_reader():
    """A fresh reader for one pull: line -> Transfer of layers, or None."""
    layers: dict[str, bool] = {}

    def read(line: str) -> Transfer | None:
        podman = PODMAN_BLOB.match(line)
        docker = DOCKER_LAYER.match(line)
        if podman:
            key, tail = podman[1][:12], podman[2].lower()
            layers[key] = layers.get(key, False) or any(word in tail for word in DONE)
        elif docker:
            layers[docker[1]] = layers.get(docker[1], False) or docker[2] in ("Pull complete", "Already exists")
        elif line.startswith("Copying config") and layers:
            for key in layers:
                layers[key] = True
        else:
            return None
        return Transfer(sum(layers.values()), len(layers), "layers")

    return read
