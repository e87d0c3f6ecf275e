"""Day-2 operations on a deployed fleet: status, start/stop/restart, recover,
logs, endpoints, the diffusion benchmark. Each runs through the engine
(converge): roles of its own for what changes a host, the engine's streaming
for logs; none opens a connection itself."""
