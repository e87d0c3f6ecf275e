"""What the roles share to serve a model on a host, below them all and importing none of them:
the catalogs (``catalog/``), the replicas and their units (``replicas.py``, ``serving_host.py``,
``container_unit/``, ``systemd.py``, ``nixos_module.py``), ``vllm serve``'s arguments
(``vllm_serve/``), the readiness loop (``replica_ready/``), HAProxy as the front doors and the
gateways run it (``haproxy/``), the fleet as a host sees it (``fleet.py``, ``declared.py``,
``scrape_targets.py``, ``key_limits.py``), what one role hands the next (``handoffs.py``), and
the programs a host runs, kept as shell files with their protocols (``host_programs.py`` and the
``*.sh`` libraries). roles/ holds the roles alone."""
