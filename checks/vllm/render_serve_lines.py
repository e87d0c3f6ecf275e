"""Every `vllm serve` line the toolkit renders, as JSON (a list of argument lists): each host of
the shipped inventory and of the inventory named (the lab's), each model family, with the
inventory's generation defaults and with a family's own set."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import roles  # noqa: E402
from converge.play import Play  # noqa: E402
from serving.vllm_serve import serve_args  # noqa: E402

MODELS = {"diffusiongemma": "google/diffusiongemma-26B-A4B-it", "gemma4": "google/gemma-4-26B-A4B-it"}
lines = []
for inventory in ["inventory"] + [p for p in sys.argv[1:] if os.path.exists(p)]:
    play = Play.load(inventory, roles.schemas(), roles.defaults(), [])
    for host in play.inventory.select("all"):
        v = play.hostvars(host)
        for family, model in MODELS.items():
            own = {"generation_defaults": {family: {"max_new_tokens": 2048, "temperature": 0.7, "top_p": 0.95}}}
            for extra in ({}, own):
                lines.append(serve_args({**v, **extra}, model, 0.7, 2, 8100, family=family))
print(json.dumps(lines))
