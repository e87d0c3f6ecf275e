"""Which model family a host serves on which of its GPUs: the inventory's ``models:``, one
entry per family, each with the GPUs it takes (``gpus:``: all that are left, a count, or
indices and uuids) and, optionally, its variant, quantization and serving settings.

Without ``models:`` a host serves DiffusionGemma on the GPUs ``gpus:`` allows, as it did
before families could be declared. Pure."""
from __future__ import annotations

from dataclasses import dataclass, field

from converge.errors import StepFailed
from serving import catalog
from serving.catalog import DEFAULT_FAMILY


class Refused(StepFailed):
    """No image or model can serve on this host; the message says what to do."""

# what an entry may set for its own replicas alone (a change rolls only those)
ENTRY_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_thinking",
                  "gpu_memory_utilization", "extra_serve_args")


@dataclass(frozen=True)
class Declared:
    family: str
    gpus: object  # "all" (the GPUs no other entry takes), a count, or a list of indices and uuids
    model: str | None = None
    quantization: str = "auto"
    settings: dict = field(default_factory=dict)
    where: str = "gpus"  # the variable that declared it, for messages

    @property
    def named(self) -> bool:
        return isinstance(self.gpus, list)

    @property
    def counted(self) -> bool:
        return isinstance(self.gpus, int) and not isinstance(self.gpus, bool)


def declared(hostvars: dict) -> list[Declared]:
    """The host's entries, in the order they take GPUs: named GPUs first, then counts (in
    inventory order), then the one that takes the rest. Refused with the entry's key when an
    entry names a family the catalog lacks, or two take the rest."""
    families = catalog.models()["families"]
    for family in hostvars.get("generation_defaults") or {}:
        if family not in families:
            raise Refused(f"generation_defaults.{family}: {family!r} is not in the model catalog "
                          f"(serving/catalog/models.yml); it has {', '.join(families)}")
    entries = hostvars.get("models")
    if not entries:
        return [Declared(DEFAULT_FAMILY, hostvars.get("gpus", "all"), hostvars.get("model"),
                         hostvars.get("quantization", "auto"))]
    out, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        family = entry["family"]
        if family not in families:
            raise Refused(f"{where}.family: {family!r} is not in the model catalog (serving/catalog/models.yml); "
                          f"it has {', '.join(families)}")
        if family in seen:
            raise Refused(f"{where}.family: {family} is declared twice for this host: give it one entry with "
                          f"the GPUs it takes")
        seen.add(family)
        model = entry.get("model")
        if model:
            spec = catalog.models()["variants"].get(model)
            if spec and spec["family"] != family:
                raise Refused(f"{where}.model: {model} is a {spec['family']} variant, not {family}")
        out.append(Declared(family, entry.get("gpus", "all"), model, entry.get("quantization", "auto"),
                            {k: entry[k] for k in ENTRY_SETTINGS if k in entry}, where))
    rest = [e for e in out if not e.named and not e.counted]
    if len(rest) > 1:
        raise Refused(f"{rest[1].where}.gpus: both {rest[0].family} and {rest[1].family} take every GPU left: "
                      f"give one of them a count or a list of GPUs")
    return [e for e in out if e.named] + [e for e in out if e.counted] + rest


def family_of(model: str, default: str) -> str:
    """The family of a variant: the catalog's, or ``default`` for a model the catalog lacks."""
    spec = catalog.models()["variants"].get(model)
    return spec["family"] if spec else default


def title(family: str) -> str:
    return catalog.models()["families"].get(family, {}).get("title", family)


def served_name(family: str, hostvars: dict) -> str:
    """The alias a family's replicas answer to: ``served_model_name`` for DiffusionGemma (as
    before families), the catalog's for the others."""
    if family == DEFAULT_FAMILY:
        return hostvars.get("served_model_name", "diffusiongemma")
    return catalog.models()["families"][family]["served_name"]


def is_diffusion(family: str) -> bool:
    return catalog.models()["families"].get(family, {}).get("kind") == "diffusion"


def served_names(family: str, hostvars: dict) -> list[str]:
    """Every name a family's replicas answer to: its alias, then the aliases of the families
    whose requests fall back to it (``model_fallback``: the gateway sends them on unchanged,
    and vLLM refuses a name it does not serve)."""
    names = [served_name(family, hostvars)]
    for source, rule in (hostvars.get("model_fallback") or {}).items():
        if rule.get("to") == family and source in catalog.models()["families"]:
            names.append(served_name(source, hostvars))
    return list(dict.fromkeys(names))
