"""The vLLM images of the lab, one per arch, built from that arch's rootfs with
the vLLM stand-in and the real ``hf`` CLI (huggingface_hub) inside, and pushed
to the lab registry under the real tag names."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from . import config, debs, haproxy_package, rootfs, sh
from .slimroot import SlimRoot

IMAGE_VERSION = "6"  # 5: small roots (lab/slimroot.py), not the whole base; 6: PATH, as the official image has
HF_SITE_VERSION = "4"
# pure-Python wheels: the same files serve both arches (hf_xet is left out: HF_HUB_DISABLE_XET=1)
HF_REQUIREMENTS = ["huggingface_hub==2.4.0"]
# what every small image of the lab carries besides its programs: a shell (the official
# images' entrypoints are shell scripts, and `docker exec … sh -c` works in them), the CA
# certificates, the base's users, its os-release
SHELL_PROGRAMS = ("/usr/bin/dash", "/usr/bin/env", "/usr/bin/uname")
COMMON_PATHS = ("/bin/sh", "/etc/ssl", "/usr/lib/ssl", "/usr/share/ca-certificates", "/etc/passwd", "/etc/group",
                "/etc/os-release")
# the vLLM stand-in's: Python and its standard library (vLLM's own image is Python's), whose
# extension modules bring the libraries they link
PYTHON_PATHS = ("/usr/bin/python3", "/usr/lib/python3.11", "/etc/python3.11")
PYTHON_MODULES = ("/usr/lib/python3.11/lib-dynload",)


def _hf_site() -> Path:
    site = config.CACHE / f"hf-site-{HF_SITE_VERSION}"
    if (site / ".done").exists():
        return site
    shutil.rmtree(site, ignore_errors=True)
    wheels = config.CACHE / "hf-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    sh.run(sys.executable, "-m", "pip", "download", "-q", "-d", wheels, *HF_REQUIREMENTS, timeout=900)
    pure = [w for w in wheels.glob("*.whl") if w.name.endswith("-none-any.whl")]
    sh.run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", site, *pure, timeout=900)
    shutil.rmtree(site / "bin", ignore_errors=True)
    (site / ".done").touch()
    return site


def _extras(arch: str, cold_start: float) -> Path:
    extras = config.CACHE / f"image-extras-{arch}"
    shutil.rmtree(extras, ignore_errors=True)
    site = _hf_site()
    target = extras / "usr/local/lib/python3.11/dist-packages"
    target.parent.mkdir(parents=True)
    shutil.copytree(site, target)
    (target / ".done").unlink(missing_ok=True)
    bindir = extras / "usr/local/bin"
    bindir.mkdir(parents=True)
    shutil.copy2(config.HERE / "stubs" / "vllm", bindir / "vllm")
    (bindir / "hf").write_text("#!/usr/bin/python3\nimport sys\nfrom huggingface_hub.cli.hf import main\n"
                               "sys.exit(main())\n")
    (bindir / "hf").chmod(0o755)
    share = extras / "usr/local/share/vllm-standin"
    share.mkdir(parents=True)
    shutil.copy2(config.HERE / "stubs" / "vllm-serve-options.txt", share / "serve-options.txt")
    shutil.copy2(config.HERE / "stubs" / "vllm-routes.txt", share / "routes.txt")
    shutil.copy2(config.HERE / "stubs" / "vllm_chat.py", share / "vllm_chat.py")  # the stand-in imports it
    (share / "arch").write_text(arch + "\n")
    (share / "cold-start").write_text(f"{cold_start}\n")
    return extras


def _fingerprint(arch: str, cold_start: float) -> str:
    digest = hashlib.sha256(f"{IMAGE_VERSION} {arch} {cold_start} {rootfs.BASE_VERSION}".encode())
    for name in ("vllm", "vllm_chat.py", "vllm-serve-options.txt", "vllm-routes.txt"):
        digest.update((config.HERE / "stubs" / name).read_bytes())
    return digest.hexdigest()[:16]


# what the official haproxy image's docker-entrypoint.sh does: `haproxy ...` runs in
# master-worker mode (-W, reloads on SIGUSR2) in the foreground (-db)
HAPROXY_ENTRYPOINT = """#!/bin/sh
set -e
if [ "${1#-}" != "$1" ]; then
    set -- haproxy "$@"
fi
if [ "$1" = 'haproxy' ]; then
    shift
    set -- haproxy -W -db "$@"
fi
exec "$@"
"""


def _import(arch: str, local: str, programs: tuple[str, ...], paths: tuple[str, ...], extras: Path | None,
            changes: list[str], log, modules: tuple[str, ...] = ()):
    """A small image (lab/slimroot.py): ``programs`` and ``paths`` of the arch's base (and the
    libraries the shared objects in ``modules`` link), with what the shell needs and ``extras``
    over them."""
    tarball = config.CACHE / f"image-{arch}.tar"
    staging = config.CACHE / f"image-{arch}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    root = SlimRoot(rootfs.ensure_base(arch, log), staging)
    for program in (*SHELL_PROGRAMS, *programs):
        root.program(program)
    for path in (*COMMON_PATHS, *paths):
        root.path(path)
    for folder in modules:
        root.extension_modules(folder)
    for folder in ("/root", "/var/tmp", "/run"):
        root.folder(folder)
    root.folder("/tmp", 0o1777)
    if extras is not None:
        sh.run("cp", "-a", "--remove-destination", f"{extras}/.", staging, timeout=300)
    sh.run("tar", "-C", staging, "-cf", tarball, ".", timeout=900)
    shutil.rmtree(staging)
    args = ["podman", "import", "--arch", config.DEB_ARCH[arch]]
    for change in changes:
        args += ["--change", change]
    sh.run(*args, tarball, local, timeout=900)
    tarball.unlink()


def _pushed(stamp: Path, digest: str, target: str) -> bool:
    """This build (``digest``) was pushed, and the registry still has it (a fresh registry
    volume does not)."""
    return stamp.exists() and stamp.read_text().strip() == digest and sh.ok(
        "skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{target}")


def _new_manifest(listed: str) -> str:
    sh.run("podman", "manifest", "rm", listed, check=False)
    sh.run("podman", "manifest", "create", listed)
    return listed


def _push_manifest(listed: str, target: str, stamp: Path, digest: str):
    sh.run("podman", "manifest", "push", "-q", "--all", "--tls-verify=false", listed, f"docker://{target}",
           timeout=900)
    stamp.write_text(digest + "\n")


def ensure_frontdoor_image(log=print):
    """library/haproxy:3.0 in the lab registry: Debian 13's HAProxy 3.0 LTS package with its
    libraries (lab/haproxy_package.py) over the base's shell, run as the official image runs
    it, one image per arch under one tag (a manifest list)."""
    digest = hashlib.sha256(f"{IMAGE_VERSION} {rootfs.BASE_VERSION} {HAPROXY_ENTRYPOINT} "
                            f"{haproxy_package.PACKAGES}".encode()).hexdigest()[:16]
    stamp = config.CACHE / "image-frontdoor.pushed"
    target = f"{config.REGISTRY_LOCAL}/{config.FRONTDOOR_REPOSITORY}:{config.FRONTDOOR_TAG}"
    if _pushed(stamp, digest, target):
        return
    listed = _new_manifest(f"localhost/dglab-haproxy:list-{digest}")
    for arch in config.IMAGE_TAGS:
        local = f"localhost/dglab-haproxy:{arch}-{digest}"
        if not sh.ok("podman", "image", "exists", local):
            package = haproxy_package.ensure(arch, log)
            log(f"building the {arch} front door image (Debian 13's haproxy {haproxy_package.BRANCH})")
            extras = config.CACHE / f"frontdoor-extras-{arch}"
            shutil.rmtree(extras, ignore_errors=True)
            # the package's usr/ (its binary, its loader and libraries: Debian 13's, which the base's
            # shell runs on too) over the base's
            (extras / "usr").mkdir(parents=True)
            sh.run("cp", "-a", f"{package / 'usr'}/.", extras / "usr", timeout=300)
            (extras / "usr/local/bin").mkdir(parents=True, exist_ok=True)
            entry = extras / "usr/local/bin/docker-entrypoint.sh"
            entry.write_text(HAPROXY_ENTRYPOINT)
            entry.chmod(0o755)
            (extras / "usr/local/etc/haproxy").mkdir(parents=True)
            _import(arch, local, (), (), extras,
                    ['ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]',
                     'CMD ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]', "STOPSIGNAL SIGUSR1",
                     "USER haproxy"], log)
        sh.run("podman", "manifest", "add", listed, f"containers-storage:{local}")
    log(f"pushing {config.FRONTDOOR_REPOSITORY}:{config.FRONTDOOR_TAG} to the lab registry")
    _push_manifest(listed, target, stamp, digest)


# the official images' own settings (their Dockerfiles): the program as entrypoint, nobody
MONITORING_SETTINGS = {
    "node_exporter": ['EXPOSE 9100', 'USER nobody'],
    "prometheus": ['CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]',
                   'EXPOSE 9090', 'WORKDIR /prometheus', 'USER nobody'],
    "alertmanager": ['CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]',
                     'EXPOSE 9093', 'WORKDIR /alertmanager', 'USER nobody'],
}


def ensure_monitoring_images(log=print):
    """prom/node-exporter, prom/prometheus and prom/alertmanager (both arches, one tag each) in
    the lab registry: Debian's packages, run as the official images run them, and as small:
    the program, the libraries it links, what its package ships in /usr/share (Prometheus's
    web UI), CA certificates and a passwd with nobody; no shell, no base system."""
    for name, (repository, tag, package, program, official, arches) in config.MONITORING_IMAGES.items():
        digest = hashlib.sha256(f"{IMAGE_VERSION} {rootfs.BASE_VERSION} {name} {tag} {MONITORING_SETTINGS[name]} "
                                f"{arches}".encode()).hexdigest()[:16]
        stamp = config.CACHE / f"image-{name}.pushed"
        target = f"{config.REGISTRY_LOCAL}/{repository}:{tag}"
        if _pushed(stamp, digest, target):
            continue
        listed = _new_manifest(f"localhost/dglab-{name}:list-{digest}")
        for arch in arches:
            local = f"localhost/dglab-{name}:{arch}-{digest}"
            if not sh.ok("podman", "image", "exists", local):
                log(f"building the {arch} {repository} image (Debian's package)")
                base = rootfs.ensure_base(arch, log)
                # the package and what it needs that the base lacks (the node exporter's: nothing, the
                # base carries it, config.PACKAGES)
                unpacked = debs.unpacked([package], base, f"{name}-{arch}", log, arch)
                root = config.CACHE / f"{name}-image-{arch}"
                shutil.rmtree(root, ignore_errors=True)
                _small_root(root, base, unpacked, program, official)
                tarball = config.CACHE / f"{name}-image-{arch}.tar"
                sh.run("tar", "-C", root, "-cf", tarball, ".", timeout=300)
                args = ["podman", "import", "--arch", config.DEB_ARCH[arch]]
                for change in [f'ENTRYPOINT ["{official}"]', *MONITORING_SETTINGS[name]]:
                    args += ["--change", change]
                sh.run(*args, tarball, local, timeout=300)
                tarball.unlink()
                shutil.rmtree(root)
            sh.run("podman", "manifest", "add", listed, f"containers-storage:{local}")
        log(f"pushing {repository}:{tag} to the lab registry")
        _push_manifest(listed, target, stamp, digest)


def _small_root(root: Path, base: Path, unpacked: Path, program: str, official: str):
    """An image's root: ``program`` (from the unpacked package, else the base) at ``official``,
    the libraries its ELF header names (and theirs) from the base, the package's /usr/share, the
    base's CA certificates, and /etc/passwd and /etc/group with root and nobody."""
    packaged = unpacked / program.lstrip("/")
    slim = SlimRoot(base, root)
    slim.program(official, source=packaged if packaged.exists() else base / program.lstrip("/"))
    if (unpacked / "usr/share").exists():
        shutil.copytree(unpacked / "usr/share", root / "usr/share", symlinks=True, dirs_exist_ok=True)
    if (base / "etc/ssl/certs/ca-certificates.crt").exists():
        slim.path("/etc/ssl/certs/ca-certificates.crt")
    slim.file("/etc/passwd", "root:x:0:0:root:/root:/sbin/nologin\n"
                             "nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n")
    slim.file("/etc/group", "root:x:0:\nnogroup:x:65534:\n")
    for folder in ("prometheus", "alertmanager"):
        slim.folder(f"/{folder}")
    slim.folder("/tmp", 0o1777)


def ensure_images(cold_start: float = config.COLD_START_S, log=print):
    """Build (when its inputs changed) and push each arch's image under every tag."""
    ensure_frontdoor_image(log)
    ensure_monitoring_images(log)
    for arch, tags in config.IMAGE_TAGS.items():
        stamp = config.CACHE / f"image-{arch}.pushed"
        fp = _fingerprint(arch, cold_start)
        if stamp.exists() and stamp.read_text().strip() == fp and _in_registry(tags[0]):
            continue
        local = f"localhost/dglab-vllm:{arch}-{fp}"
        if not sh.ok("podman", "image", "exists", local):
            log(f"building the {arch} vLLM stand-in image")
            _import(arch, local, ("/usr/bin/python3.11",), PYTHON_PATHS, _extras(arch, cold_start),
                    ['ENTRYPOINT ["/usr/local/bin/vllm", "serve"]',
                     # the official image's PATH (its CUDA base's): a pod's `command: [vllm, serve, ...]`
                     # (production-stack's chart) finds vllm by it
                     "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     f"ENV VLLM_STANDIN_COLD_START={cold_start}",
                     "ENV HF_HUB_DISABLE_XET=1", "ENV PYTHONUNBUFFERED=1"], log, modules=PYTHON_MODULES)
        for tag in tags:
            log(f"pushing {config.REPOSITORY}:{tag} to the lab registry")
            sh.run("podman", "push", "-q", "--tls-verify=false", local,
                   f"{config.REGISTRY_LOCAL}/{config.REPOSITORY}:{tag}", timeout=900)
        stamp.write_text(fp + "\n")


FAULTS = ("exits", "500")


def fault_tag(arch: str, fault: str) -> str:
    return f"{config.IMAGE_TAGS[arch][0]}-fault-{fault}"


def release_tag(arch: str, release: int) -> str:
    return f"{config.IMAGE_TAGS[arch][0]}-r{release}"


RELEASE_MIB = 2  # what each release adds over the good image: a layer of its own, so that pruning it frees space


def _over_good_image(tag_of, containerfile: str, log, context: Path | None = None) -> dict[str, str]:
    """An image of each arch built over the good one (``containerfile`` after its FROM line: nothing
    runs, so either arch builds here), pushed as ``tag_of(arch)``; returns arch -> the reference
    hosts pull it by (through the lab's registry)."""
    refs = {}
    for arch in config.IMAGE_TAGS:
        stamp = config.CACHE / f"image-{arch}.pushed"
        good = f"localhost/dglab-vllm:{arch}-{stamp.read_text().strip()}" if stamp.exists() else None
        if good is None or not sh.ok("podman", "image", "exists", good):
            raise RuntimeError(f"the lab's {arch} image is not built: run invoke lab.up first")
        tag = tag_of(arch)
        local = f"localhost/dglab-vllm:{tag}"
        sh.run("podman", "build", "-q", "--pull=never", "--arch", config.DEB_ARCH[arch], "-t", local, "-f", "-",
               *([context] if context else []), input=f"FROM {good}\n{containerfile}", timeout=300)
        log(f"pushing {config.REPOSITORY}:{tag} to the lab registry")
        sh.run("podman", "push", "-q", "--tls-verify=false", local, f"{config.REGISTRY_LOCAL}/{config.REPOSITORY}:{tag}",
               timeout=900)
        refs[arch] = f"{config.REGISTRY}/{config.REPOSITORY}:{tag}"
    return refs


def ensure_fault_image(fault: str, log=print) -> dict[str, str]:
    """A bad release of each arch's image (the stand-in with ``VLLM_STANDIN_FAULT``: it
    starts and exits, or answers 500 to generation), pushed beside the good tags; returns
    arch -> the reference hosts pull it by (through the lab's registry)."""
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}: one of {', '.join(FAULTS)}")
    # one layer of configuration over the good image
    return _over_good_image(lambda arch: fault_tag(arch, fault), f"ENV VLLM_STANDIN_FAULT={fault}\n", log)


def ensure_release_image(release: int, log=print) -> dict[str, str]:
    """Another release of each arch's good image, ``<tag>-r<N>``: the same stand-in, with
    ``VLLM_STANDIN_RELEASE=N`` and a layer of RELEASE_MIB of its own (what a new vLLM brings, in
    small), so that releases differ by digest and by the space pruning one frees."""
    if not 1 <= release <= 999:
        raise ValueError(f"release {release}: from 1 to 999")
    context = config.CACHE / f"release-{release}"
    context.mkdir(parents=True, exist_ok=True)
    payload = context / "release.bin"
    if not payload.exists() or payload.stat().st_size != RELEASE_MIB << 20:
        # its own bytes (seeded by the release): two releases share no layer
        seed = hashlib.sha256(f"release {release}".encode()).digest()
        blocks, block = [], seed
        while len(blocks) * 32 < RELEASE_MIB << 20:
            block = hashlib.sha256(block).digest()
            blocks.append(block)
        payload.write_bytes(b"".join(blocks)[:RELEASE_MIB << 20])
    return _over_good_image(lambda arch: release_tag(arch, release),
                            f"ENV VLLM_STANDIN_RELEASE={release}\nCOPY release.bin /usr/local/share/vllm-standin/release.bin\n",
                            log, context)


def _in_registry(tag: str) -> bool:
    return sh.ok("skopeo", "inspect", "--tls-verify=false", "--raw",
                 f"docker://{config.REGISTRY_LOCAL}/{config.REPOSITORY}:{tag}")


def registry_digest(tag: str) -> str | None:
    proc = sh.run("skopeo", "inspect", "--tls-verify=false",
                  f"docker://{config.REGISTRY_LOCAL}/{config.REPOSITORY}:{tag}", check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout).get("Digest")
