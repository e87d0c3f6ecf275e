"""What deploy knows of a host and tells Prometheus through the node exporter's textfile
collector (``/var/lib/dgemma/metrics/*.prom``): which GPU serves which replica and which
were left out and why, the replicas' models and diffusion settings, and when the
certificates the host serves with expire. Written when deploy changes them; the node
exporter reads them at each scrape. Pure."""
from __future__ import annotations

# the diffusion settings a replica is started with (seed 001: why an output came out rough)
DIFFUSION_SETTINGS = ("canvas_length", "max_denoising_steps", "diffusion_sampler", "diffusion_entropy_bound")


def escape(value) -> str:
    """A label value as Prometheus's text format writes it."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels(**pairs) -> str:
    return ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items())


def _family(name: str, doc: str, samples: list[str]) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} gauge\n" + "".join(s + "\n" for s in samples)


def placement(gpus: list[dict], declared: tuple, skipped: list[dict], settings: dict[int, dict]) -> str:
    """``gpus``: the host's GPUs (nvidia-smi's rows: index, uuid); ``declared``: each placed
    replica as the service role declares it (serving.handoffs.UnitPlan); ``skipped``: the GPUs
    left out (uuid, reason); ``settings``: each replica's diffusion settings by index."""
    serving = {uuid: plan.replica for plan in declared for uuid in plan.replica.gpus}
    why = {s["uuid"]: s.get("reason", "") for s in skipped}
    placed = []
    for gpu in gpus:
        r = serving.get(gpu["uuid"])
        placed.append(f"dgemma_gpu_placed{{{labels(gpu=gpu['index'], UUID=gpu['uuid'])},"
                      f"{labels(replica='' if r is None else r.index, model='' if r is None else r.family)},"
                      f"{labels(reason='' if r is not None else why.get(gpu['uuid'], 'not declared for a model'))}}} "
                      f"{0 if r is None else 1}")
    info = []
    for plan in sorted(declared, key=lambda p: p.replica.index):
        r = plan.replica
        extra = {k: settings.get(r.index, {}).get(k, "") for k in DIFFUSION_SETTINGS} \
            if r.family == "diffusiongemma" else {}
        info.append(f"dgemma_replica_info{{{labels(replica=r.index, model=r.family, variant=plan.served.model, gpu_uuid=','.join(r.gpus), unit=r.unit, **extra)}}} 1")
    return (_family("dgemma_gpu_placed", "Whether deploy placed a replica on this GPU (1) or left it out (0: the reason "
                                         "label says why).", placed)
            + _family("dgemma_replica_info", "A replica deploy placed here: its model, checkpoint, GPUs, unit and "
                                             "diffusion settings.", info))


def certificates(certs: dict[str, float]) -> str:
    """``certs``: what each certificate is (``frontdoor``, ``gateway``, ``ca``) -> its notAfter (Unix time)."""
    return _family("dgemma_tls_certificate_expiry_timestamp_seconds",
                   "When a certificate this host serves with (or trusts: ca) expires, in Unix time.",
                   [f"dgemma_tls_certificate_expiry_timestamp_seconds{{{labels(certificate=kind)}}} {at:.0f}"
                    for kind, at in sorted(certs.items())])
