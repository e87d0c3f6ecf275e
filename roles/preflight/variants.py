"""The catalog's variants of a model family a GPU may run, in preference order, and the
refusal when none can serve: what placement (each GPU) and selection (the host)
both read. Pure."""
from __future__ import annotations

from serving import catalog
from serving.declared import Refused  # noqa: F401 (placement and selection raise it from here)


def version(text: str) -> tuple:
    """A dotted version ("12.0", "13.0") as a tuple of numbers, for comparisons."""
    return tuple(int(p) for p in str(text).split("."))


def candidates(cc: str, hostvars: dict, family: str = "diffusiongemma") -> list[tuple[str, dict]]:
    """The variants of ``family`` for compute capability ``cc``: the inventory's ``model``, or the
    catalog's preference for ``quantization`` (auto: the family's order for this GPU generation)."""
    cat = catalog.models()["variants"]
    if hostvars.get("model"):
        model = hostvars["model"]
        return [(model, cat.get(model, {}))]
    fam = catalog.models()["families"][family]
    have = version(cc)
    wanted = hostvars.get("quantization", "auto")
    mine = {model: spec for model, spec in cat.items() if spec["family"] == family}
    if wanted != "auto" and not any(spec["quantization"] == wanted for spec in mine.values()):
        kinds = sorted({spec["quantization"] for spec in mine.values()})
        raise Refused(f"{fam['title']} has no {wanted} variant in the catalog (it has {', '.join(kinds)}): "
                      f"set quantization: auto")
    for row in fam["preference"]:
        if have >= version(row["min_compute_capability"]):
            order = row["order"] if wanted == "auto" else [wanted]
            out = []
            for quant in order:
                for model, spec in mine.items():
                    if spec["quantization"] == quant:
                        if have < version(spec["min_compute_capability"]):
                            raise Refused(f"{quant} needs compute capability {spec['min_compute_capability']} "
                                          f"or newer; this GPU has {cc}. Set quantization: auto")
                        out.append((model, spec))
            return out
    lowest = min(version(row["min_compute_capability"]) for row in fam["preference"])
    raise Refused(f"compute capability {cc} is older than any {fam['title']} variant supports "
                  f"({'.'.join(map(str, lowest))})")
