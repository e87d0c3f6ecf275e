"""A fleet's inventory rendered for Kubernetes (``invoke render --target kubernetes``): the same
choices the SSH deploy makes for each host (image tag, model variant, memory fraction, diffusion
settings, replicas per GPU), written as vLLM production-stack values placed by GPU Feature
Discovery labels, the keys' limits as Envoy Gateway / AI Gateway policies, the alerts as a
PrometheusRule, scraping as ServiceMonitors and dashboards as ConfigMaps; every file checked
against the projects' own schemas (``schemas/``, vendored at pinned commits). Pure but for
``render.write``; it reaches no host (the facts come from ``invoke facts``'s run or a file)."""
