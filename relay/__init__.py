"""The run's artifact relay: each artifact crosses the uplink once per run.

``server``: the HTTP relay on the control machine; ``service``: how a run offers
it to its hosts' roles (the engine's per-run service hook, converge.runner.RunService);
the step that asks whether a host reaches it is the roles' (serving/relay_probe.py).
"""
