"""HAProxy as the fleet runs it, apart from the roles that run it: the front door
(roles/frontdoor) on every serving host and the gateway (roles/gateway) on the gateways.
``instance``: the two kinds, their sockets, container and unit; ``config``: their
configurations, two templates over shared parts; ``steps``: the steps of one instance
(files, image, unit, start or reload, the wait for its new generation); ``tls``: the
certificates and key hashes they serve; ``pools``: the model families they route;
``stats``: what an instance says of its servers."""
