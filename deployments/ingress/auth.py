"""Who may call what, decided from the request's headers before its body is read.

:class:`AuthGuard` is the ingress's outermost ASGI middleware. For every HTTP request it asks
the :class:`Gate` for a :class:`Principal`; a refusal is answered at once (OpenAI's error
envelope), so a request without a valid key costs a header lookup, never a parse. The rules
(``docs/security.md``, "Who may call what"):

- ``/health`` is open (readiness probes carry no key).
- ``ingress.auth: none``: no keys; every request is tenant ``anonymous`` and may reach every
  route (an explicit choice, for an endpoint nobody else can reach).
- ``ingress.auth: keys``: every other route needs ``Authorization: Bearer KEY``. The operator
  routes (``/v1/pdserve/*``: stats, route explanations, resets) need an operator key; the rest
  (the OpenAI routes, ``/tokenize``, ``/detokenize``) a tenant key. Each kind reaches only its
  own routes (least privilege); the API's schema and docs are readable with either.
- A client address that sent ``ingress.max_auth_failures`` failed keys (refilled at
  ``ingress.auth_failures_per_minute``) gets 429 for every further unknown key, and its keys
  are then looked up only where that costs nothing (the config's, the keys file's, Redis
  answers already cached): no Redis call per guess. A valid key still passes, so an attacker
  behind the same address (a NAT, a load balancer) cannot lock other tenants out.
- A tenant's ``POST`` (every route that does work) takes one unit from its requests bucket
  here, before the body is read: a request refused later still cost its tenant a request.

The gate is set per ingress replica by :func:`configure` (the ingress core builds it), or
given to the middleware directly (tests). The principal travels in the ASGI scope under
:data:`PRINCIPAL`.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cluster.tenants import OPERATOR, Charge, KeyStore, KeyStoreUnavailable, RateLimiter
from controllers.tenants import Bucket, take
from deployments.ingress.openai_requests import RequestError

#: the scope key the principal travels under
PRINCIPAL = "pdserve.principal"
ANONYMOUS = "anonymous"
#: routes that need no key
OPEN_PATHS = frozenset({"/health"})
#: routes any valid key (tenant or operator) may read: the API's own description
SHARED_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
#: the operator routes' prefix
OPERATOR_PREFIX = "/v1/pdserve/"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (``operator`` False), or the operator (``tenant`` is
    :data:`cluster.tenants.OPERATOR`). With ``ingress.auth: none`` the tenant is
    ``anonymous`` and ``operator`` True (no keys: every route is reachable)."""

    tenant: str
    operator: bool = False


class AuthFailures:
    """Failed keys per client address, as a GCRA bucket each (:mod:`controllers.tenants`):
    ``burst`` failures at once, refilled at ``per_minute``. At most ``max_addresses`` are
    remembered (the least recently failed go first), so a flood of addresses costs bounded
    memory. ``clock`` is injected for tests."""

    def __init__(
        self,
        burst: int,
        per_minute: float,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 65_536,
    ) -> None:
        self.bucket = Bucket(per_minute / 60.0, float(burst))
        self.clock = clock
        self.max_addresses = max_addresses
        self._tat: OrderedDict[str, float] = OrderedDict()

    def retry_after(self, addr: str) -> float | None:
        """Seconds until ``addr`` may try a key again, or None when it may now."""
        tat = self._tat.get(addr)
        if tat is None:
            return None
        got = take(self.bucket, tat, self.clock(), 1.0)
        return None if got.allowed else got.retry_after_s

    def failed(self, addr: str) -> None:
        """Count one failed key from ``addr`` (taken even past the bound)."""
        now = self.clock()
        tat = self._tat.pop(addr, 0.0)
        self._tat[addr] = max(tat, now) + 1.0 / self.bucket.rate
        while len(self._tat) > self.max_addresses:
            self._tat.popitem(last=False)


def _bearer(headers: Mapping[str, str]) -> str:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def _refusal(status: int, message: str, code: str, headers: dict[str, str]) -> RequestError:
    return RequestError(message, None, status=status, headers=headers, code=code)


class Gate:
    """The decision of :class:`AuthGuard` (see the module docstring), over the ingress's key
    store and rate limiter. ``limits(tenant)`` gives a tenant's ``{bucket: (rate, capacity)}``;
    ``on_refused(tenant, reason)`` counts a refusal (metrics)."""

    def __init__(
        self,
        auth: str,
        keys: KeyStore,
        limiter: RateLimiter,
        limits: Callable[[str], Mapping[str, tuple[float, float]]],
        failures: AuthFailures,
        on_refused: Callable[[str, str], None] = lambda tenant, reason: None,
    ) -> None:
        self.auth = auth
        self.keys = keys
        self.limiter = limiter
        self.limits = limits
        self.failures = failures
        self.on_refused = on_refused
        #: refusals by reason (``/v1/pdserve/stats``: ``ingress.auth``)
        self.refused: dict[str, int] = {}

    def _no(self, tenant: str, reason: str, err: RequestError) -> RequestError:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.on_refused(tenant, reason)
        return err

    async def check(
        self, method: str, path: str, headers: Mapping[str, str], client: str | None
    ) -> Principal | None:
        """The caller of ``method path``, or None for an open route; raises
        :class:`RequestError` (401, 403, 429, 503) to refuse. ``headers`` have lowercase
        names."""
        if path in OPEN_PATHS:
            return None
        if self.auth == "none":
            who = Principal(ANONYMOUS, operator=True)
        else:
            who = await self._authenticate(headers, client or "-")
            operator_route = path.startswith(OPERATOR_PREFIX)
            if path not in SHARED_PATHS and operator_route != who.operator:
                need = "an operator key" if operator_route else "a tenant key"
                raise self._no(
                    who.tenant,
                    "wrong_kind_of_key",
                    _refusal(
                        403,
                        f"{path} needs {need}; "
                        + (
                            "an operator key reaches only /v1/pdserve/*"
                            if who.operator
                            else "this key is a tenant's"
                        ),
                        "permission_denied",
                        {},
                    ),
                )
        if method == "POST" and who.tenant != OPERATOR:
            await self._charge_request(who.tenant)
        return who

    async def _authenticate(self, headers: Mapping[str, str], addr: str) -> Principal:
        wait = self.failures.retry_after(addr)
        key = _bearer(headers)
        try:
            tenant = await self.keys.tenant(key, remote=wait is None) if key else None
        except KeyStoreUnavailable as e:
            raise _refusal(503, str(e), "key_store_unavailable", {"Retry-After": "1"}) from None
        if tenant is None and wait is not None:
            secs = max(1, math.ceil(wait))
            raise self._no(
                "-",
                "address_throttled",
                _refusal(
                    429,
                    f"too many failed API keys from this address; retry after {secs} s",
                    "too_many_auth_failures",
                    {"Retry-After": str(secs)},
                ),
            )
        if tenant is None:
            self.failures.failed(addr)
            raise self._no(
                "-",
                "invalid_key",
                _refusal(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                ),
            )
        return Principal(tenant, operator=tenant == OPERATOR)

    async def _charge_request(self, tenant: str) -> None:
        spec = self.limits(tenant).get("requests")
        if spec is None:
            return
        v = await self.limiter.admit(tenant, [Charge("requests", Bucket(*spec), 1.0)])
        if v.allowed:
            return
        wait = max(1, math.ceil(v.retry_after_s))
        raise self._no(
            tenant,
            "rate_limited",
            _refusal(
                429,
                f"tenant {tenant!r} is over its requests per second limit; retry after {wait} s",
                "rate_limit_exceeded",
                {"Retry-After": str(wait)},
            ),
        )


#: the gate of this process's ingress (:func:`configure`; one ingress per replica process)
_GATE: dict[str, Gate | None] = {"gate": None}


def configure(gate: Gate) -> None:
    _GATE["gate"] = gate


def principal_of(scope: Mapping[str, Any]) -> Principal | None:
    """The principal :class:`AuthGuard` put in ``scope`` (None: not through the guard)."""
    p = scope.get(PRINCIPAL)
    return p if isinstance(p, Principal) else None


class AuthGuard:
    """The ASGI middleware (see the module docstring); ``gate`` defaults to the one
    :func:`configure` set. No gate yet (the ingress still starting): 503."""

    def __init__(self, app: Any, gate: Gate | None = None) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate or _GATE["gate"]
        try:
            if gate is None:
                raise _refusal(503, "the ingress is starting", "starting", {"Retry-After": "1"})
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            client = scope.get("client")
            who = await gate.check(
                scope.get("method", "GET"),
                scope.get("path", ""),
                headers,
                client[0] if client else None,
            )
        except RequestError as e:
            await send_error(send, e)
            return
        if who is not None:
            scope[PRINCIPAL] = who
        await self.app(scope, receive, send)


async def send_error(send: Any, e: RequestError) -> None:
    """Answer with ``e``'s status, headers and OpenAI error body (the body is never read)."""
    body = json.dumps(e.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ] + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
