"""The lab: real hosts on one Debian 12 machine (systemd-nspawn, real systemd,
OpenSSH and podman, each in its own network namespace), a registry, a model
hub, and the two stand-ins that cannot be real here: the GPU's nvidia-smi and
the vLLM server inside the images."""
