"""Each key's limits as Envoy Gateway and Envoy AI Gateway enforce them in Kubernetes, the
nearest kin of the fleet's gateways: the keys by SecurityPolicy ``apiKeyAuth`` (a Secret the
operator makes, by reference: no key and no key hash leaves the control machine), each key's
requests a minute and tokens a day by a BackendTrafficPolicy's global rate limits on the
client id the key is known by (``x-dgemma-key``), the tokens counted from vLLM's usage by
the AIGatewayRoute's ``llmRequestCosts``. A front end's people count apart by their user
header, as at the fleet's gateways. Pure."""
from __future__ import annotations

from serving.key_limits import OPERATOR, Limits

KEY_HEADER = "x-dgemma-key"  # the client id Envoy sets from the key (forwardClientIDHeader)
USER_HEADER = "x-openwebui-user-email"  # a front end's user (serving/haproxy/templates/gateway.cfg.j2)
KEYS_SECRET = "dgemma-api-keys"  # one entry per key: its name -> the key itself (the operator's to make)
CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"  # Envoy Gateway's controller name
# what the render's README installs, pinned: Envoy Gateway (its chart installs the Gateway API's CRDs, v1.6.1),
# Envoy AI Gateway (whose values and rate-limit addon Envoy Gateway is installed with), at the releases whose
# CRDs kubernetes_manifests/schemas holds (SOURCES.md)
ENVOY_GATEWAY = "v1.9.0"
AI_GATEWAY = "v1.1.0"
TOKENS = "llm_total_token"  # the AI gateway's metadata key for a request's total tokens


def _target(route: str) -> list[dict]:
    return [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route}]


def _clients(name: str, limit: Limits) -> list[dict]:
    headers = [{"name": KEY_HEADER, "type": "Exact", "value": name}]
    if limit.front_end:  # each of a front end's people counts apart
        headers.append({"name": USER_HEADER, "type": "Distinct"})
    return [{"headers": headers}]


def _per_minute(clients: list[dict], requests: int) -> dict:
    return {"clientSelectors": clients, "limit": {"requests": requests, "unit": "Minute"}}


def _tokens_per_day(clients: list[dict], tokens: int) -> dict:
    """Admitted while the day's tokens last; each answer spends what vLLM's usage says it used."""
    return {"clientSelectors": clients, "limit": {"requests": tokens, "unit": "Day"},
            "cost": {"request": {"from": "Number", "number": 0},
                     "response": {"from": "Metadata", "metadata": {"namespace": "io.envoy.ai_gateway", "key": TOKENS}}}}


def rate_limit_rules(keys: dict[str, Limits]) -> list[dict]:
    rules = []
    for name, limit in sorted(keys.items()):
        if name == OPERATOR:
            continue
        if limit.front_end:  # a front end's cap as a whole, whatever its users
            whole = [{"headers": [{"name": KEY_HEADER, "type": "Exact", "value": name}]}]
            if limit.all_users_requests_per_minute:
                rules.append(_per_minute(whole, limit.all_users_requests_per_minute))
            if limit.all_users_tokens_per_day:
                rules.append(_tokens_per_day(whole, limit.all_users_tokens_per_day))
        if limit.requests_per_minute:
            rules.append(_per_minute(_clients(name, limit), limit.requests_per_minute))
        if limit.tokens_per_day:
            rules.append(_tokens_per_day(_clients(name, limit), limit.tokens_per_day))
    return rules


def tls_secret(release: str) -> str:
    """The Secret that holds the Gateway's certificate and key (the README's step makes it)."""
    return f"{release}-gateway-tls"


def gateway_class(release: str) -> str:
    return f"{release}-envoy"


def listener(release: str, namespace: str, gateway: str) -> list[dict]:
    """The GatewayClass Envoy Gateway runs and the Gateway the route attaches to: one HTTPS listener on
    443 with the fleet's certificate (TLS ends there, as at the fleet's gateways), routes of its
    namespace alone."""
    return [
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
         "metadata": {"name": gateway_class(release)}, "spec": {"controllerName": CONTROLLER}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": gateway, "namespace": namespace},
         "spec": {"gatewayClassName": gateway_class(release),
                  "listeners": [{"name": "https", "protocol": "HTTPS", "port": 443,
                                 "tls": {"mode": "Terminate",
                                         "certificateRefs": [{"group": "", "kind": "Secret",
                                                              "name": tls_secret(release)}]},
                                 "allowedRoutes": {"namespaces": {"from": "Same"}}}]}},
    ]


def made_by_steps(release: str) -> set[tuple[str, str]]:
    """(kind, name) of what no file here holds and a step makes: the README's Secrets, and the
    HTTPRoute Envoy AI Gateway makes of the AIGatewayRoute, of its name (the policies target it)."""
    return {("Secret", KEYS_SECRET), ("Secret", tls_secret(release)), ("HTTPRoute", f"{release}-api")}


def policies(keys: dict[str, Limits], release: str, namespace: str, gateway: str, families: list[str]) -> list[dict]:
    """The Envoy documents: the route to the stack's router, its key check, its limits."""
    route = f"{release}-api"
    router = f"{release}-router"
    out = [
        # the stack's router (its Service, as the chart names it), as Envoy Gateway and the AI gateway reach it
        {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "Backend",
         "metadata": {"name": router, "namespace": namespace},
         "spec": {"endpoints": [{"fqdn": {"hostname": f"{release}-router-service.{namespace}.svc.cluster.local",
                                          "port": 80}}]}},
        {"apiVersion": "aigateway.envoyproxy.io/v1beta1", "kind": "AIServiceBackend",
         "metadata": {"name": router, "namespace": namespace},
         "spec": {"schema": {"name": "OpenAI"},
                  "backendRef": {"name": router, "kind": "Backend", "group": "gateway.envoyproxy.io"}}},
        {"apiVersion": "aigateway.envoyproxy.io/v1beta1", "kind": "AIGatewayRoute",
         "metadata": {"name": route, "namespace": namespace},
         "spec": {"parentRefs": [{"name": gateway, "kind": "Gateway", "group": "gateway.networking.k8s.io"}],
                  "rules": [{"matches": [{"headers": [{"type": "Exact", "name": "x-ai-eg-model", "value": family}]}],
                             "backendRefs": [{"name": router}]} for family in families],
                  "llmRequestCosts": [{"metadataKey": TOKENS, "type": "TotalToken"}]}},
        {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "SecurityPolicy",
         "metadata": {"name": f"{release}-keys", "namespace": namespace},
         "spec": {"targetRefs": _target(route),
                  "apiKeyAuth": {"credentialRefs": [{"group": "", "kind": "Secret", "name": KEYS_SECRET}],
                                 "extractFrom": [{"headers": ["authorization"]}],
                                 "forwardClientIDHeader": KEY_HEADER, "sanitize": True}}},
    ]
    rules = rate_limit_rules(keys)
    if rules:
        out.append({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "BackendTrafficPolicy",
                    "metadata": {"name": f"{release}-key-limits", "namespace": namespace},
                    "spec": {"targetRefs": _target(route), "rateLimit": {"type": "Global", "global": {"rules": rules}}}})
    return out
