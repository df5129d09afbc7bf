"""API clients for the clusters a job spans: the operator's own, and remote ones.

    clusters = Clusters(home_api_client(), timeout=10)
    api = clusters.client(target, secret_namespace="team-a")    # raises ClusterProblem
    ...
    except Exception as e:
        problem = clusters.failed(target, "team-a", e)           # a ClusterProblem to report

A learner group in another cluster or region names a Secret, in the job's namespace, holding a
kubeconfig for it (key `kubeconfig` unless the group says otherwise). The client built from it
is cached by the Secret's uid and resourceVersion, so editing the Secret takes effect on the
next reconcile; so is a refusal, so that a broken or oversized Secret (at most
MAX_KUBECONFIG_BYTES) is parsed once per version, not on every pass of every group using it. A Secret that is missing or unusable raises `ClusterProblem`, which reconcile turns
into a Degraded condition naming the Secret. Kubeconfig contents never reach a log line or a
status message: problems say which Secret and what kind of problem, nothing more. Only inline
credentials are accepted (operator/kubeconfig.py): the operator never runs a Secret's exec
plugin nor reads a file it names.

A cluster that does not answer. Every request has a connect and a read timeout and at most
one retry, of a failed connect (`request_timeout`, `RETRIES`). A call that fails so (refused,
reset, timed out) marks the cluster down: for a backoff period (2 s, doubling to 30 s) its
`client()` raises the ClusterProblem at once, without a call, and a background thread probes
it (GET /version) when the period ends; the first answer brings it back. So a frozen
apiserver (TCP connects succeed, nothing answers) costs one timeout per outage, not one per
call and pass, and the home cluster and the other regions go on being reconciled every tick.
A changed kubeconfig Secret is tried again at once. (A thread pool per pass would bound one
pass by the slowest cluster's timeout, every pass; skipping the dead cluster bounds it once.)
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import kubernetes
import urllib3
import yaml
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from ddiloco.operator import conditions as c
from ddiloco.operator import redact
from ddiloco.operator.kubeconfig import (
    RETRIES,
    KubeconfigRefused,
    NotKubernetesAPI,
    api_client_from_kubeconfig,
)
from ddiloco.operator.plan import Target

log = logging.getLogger(__name__)

# What a call raises when the other end does not answer: a refused or reset connection
# (OSError), and urllib3's own errors, which are not OSErrors (MaxRetryError wrapping a
# NewConnectionError or ReadTimeoutError, ProtocolError, ...). The kubernetes client reports
# a TLS failure as an ApiException with status 0.
UNREACHABLE_ERRORS: Final = (
    OSError,
    urllib3.exceptions.HTTPError,
    kubernetes.client.exceptions.OpenApiException,
)
BACKOFF_S: Final = (2.0, 30.0)  # the first and the longest pause before probing again
CONNECT_TIMEOUT_S: Final = 5.0


class ClusterProblem(Exception):
    """A cluster that cannot be used now; `reason` is a Degraded condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def request_timeout(seconds: float) -> tuple[float, float]:
    """(connect, read) timeouts of one request; the TLS handshake counts as connecting, so a
    stopped apiserver whose kernel still accepts connections is noticed after `connect`."""
    return (min(seconds, CONNECT_TIMEOUT_S), seconds)


def unreachable(e: BaseException) -> bool:
    """True if a call failed without an answer from the apiserver."""
    if isinstance(e, ApiException):
        return not e.status
    return isinstance(e, OSError | urllib3.exceptions.HTTPError)


def home_api_client() -> ApiClient:
    """The operator's own cluster: in-cluster credentials, else $KUBECONFIG / ~/.kube/config."""
    cfg = Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    cfg.retries = RETRIES
    redact.register_client(cfg)
    return ApiClient(cfg)


@dataclass
class _Cached:
    version: str
    client: ApiClient


@dataclass
class _Down:
    """A cluster that did not answer: no calls until `until`, then one probe at a time."""

    version: str  # of the Secret whose client failed; a new version is tried at once
    client: ApiClient
    problem: ClusterProblem
    delay: float
    until: float
    probing: bool = False


class Clusters:
    """Clients per target; thread-safe (kopf runs sync handlers in a thread pool)."""

    def __init__(self, home: ApiClient, timeout: float = 10.0) -> None:
        self.home = home
        self.timeout = request_timeout(timeout)
        self._cache: dict[tuple[str, str, str], _Cached] = {}
        self._down: dict[tuple[str, str, str], _Down] = {}
        # Secrets whose kubeconfig was refused, by the version refused (uid/resourceVersion)
        self._bad: dict[tuple[str, str, str], tuple[str, ClusterProblem]] = {}
        self._lock = threading.Lock()
        # the last client made for each API server URL, whatever Secret it came from: how a
        # place a group left is reached for its cleanup (memory only: credentials are never
        # stored elsewhere, so after a restart only a Secret reaching it again does)
        self._by_server: dict[str, ApiClient] = {home.configuration.host: home}
        redact.register_client(home.configuration)

    def server(self, client: ApiClient) -> str:
        """A client's API server URL (what the job's status records, never a credential)."""
        return str(client.configuration.host)

    def known_server(self, target: Target, secret_namespace: str) -> str | None:
        """The API server URL a target was last reached at, without a call (None: never)."""
        if target.server is not None:
            return target.server
        if target.secret is None:
            return self.server(self.home)
        with self._lock:
            cached = self._cache.get((secret_namespace, target.secret.name, target.secret.key))
        return self.server(cached.client) if cached is not None else None

    def client(self, target: Target, secret_namespace: str, allow_stale: bool = False) -> ApiClient:
        """The client for a target. With allow_stale, a vanished Secret's last client is used
        (cleanup during a namespace deletion, when the Secret may go before the job). Raises
        ClusterProblem for a broken Secret, and for a cluster that is down (module doc)."""
        if target.server is not None:
            with self._lock:
                found = self._by_server.get(target.server)
                down = next(
                    (
                        (k, d.version)
                        for k, d in self._down.items()
                        if self.server(d.client) == target.server
                    ),
                    None,
                )
            if down is not None:  # the Secret that reaches it found it down: no call
                self._refuse_if_down(*down)
            if found is None:
                raise ClusterProblem(
                    c.CLUSTER_UNREACHABLE,
                    f"the operator holds no credentials for the cluster at {target.server} "
                    "(none since it restarted): name its kubeconfig Secret again to have it "
                    "cleaned",
                )
            return found
        if target.secret is None:
            return self.home
        ref = target.secret
        key = (secret_namespace, ref.name, ref.key)
        where = f"Secret {secret_namespace}/{ref.name}"
        try:
            secret = kubernetes.client.CoreV1Api(self.home).read_namespaced_secret(
                ref.name, secret_namespace, _request_timeout=self.timeout
            )
        except ApiException as e:
            if e.status == 404:
                with self._lock:
                    cached = self._cache.get(key)
                if allow_stale and cached is not None:
                    self._refuse_if_down(key, cached.version)
                    return cached.client
                raise ClusterProblem(
                    c.KUBECONFIG_SECRET_MISSING, f"{where} was not found"
                ) from None
            raise
        version = f"{secret.metadata.uid or ''}/{secret.metadata.resource_version or ''}"
        self._refuse_if_down(key, version)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.version == version:
                return cached.client
            bad = self._bad.get(key)
            if bad is not None and bad[0] == version:  # parsed once, refused: until it changes
                raise ClusterProblem(bad[1].reason, bad[1].message)
        try:
            client = _client_from_secret(secret.data or {}, ref.key, where)
        except ClusterProblem as p:
            with self._lock:
                self._bad[key] = (version, p)
            raise
        with self._lock:
            self._bad.pop(key, None)
        with self._lock:
            old = self._cache.pop(key, None)
            self._cache[key] = _Cached(version, client)
            host = self.server(client)
            stale = self._by_server.get(host)
            self._by_server[host] = client
            current = {id(x.client) for x in self._cache.values()} | {id(self.home)}
            # an old client is closed unless it is still the way to its server
            closing = [
                x
                for x in (stale, old.client if old is not None else None)
                if x is not None
                and id(x) not in current
                and all(x is not y for y in self._by_server.values())
            ]
        for x in closing:
            x.close()
        if old is not None:
            log.info("Reloaded kubeconfig from %s", where)
        return client

    def failed(self, target: Target, secret_namespace: str, error: BaseException) -> ClusterProblem:
        """What a failed call against a target means; a remote cluster that did not answer is
        marked down, so the next calls fail at once until a probe gets an answer."""
        problem = describe_failure(error, target, secret_namespace)
        if target.secret is None or not unreachable(error):
            return problem
        key = (secret_namespace, target.secret.name, target.secret.key)
        with self._lock:
            cached = self._cache.get(key)
            down = self._down.get(key)
            if cached is None or (down is not None and down.version == cached.version):
                return problem
            first = BACKOFF_S[0]
            self._down[key] = _Down(
                cached.version, cached.client, problem, first, time.monotonic() + first
            )
        log.warning("%s; calling it again once it answers", problem.message)
        return problem

    def down(self) -> list[str]:
        """The Secrets (namespace/name) whose clusters are down now, for logs and tests."""
        with self._lock:
            return [f"{ns}/{name}" for ns, name, _ in self._down]

    def _refuse_if_down(self, key: tuple[str, str, str], version: str) -> None:
        with self._lock:
            down = self._down.get(key)
            if down is None:
                return
            if down.version != version:  # the Secret changed: try the new one at once
                del self._down[key]
                return
            problem = ClusterProblem(down.problem.reason, down.problem.message)
            if down.probing or time.monotonic() < down.until:
                raise problem
            down.probing = True
        threading.Thread(
            target=self._probe, args=(key, down), name=f"probe-{key[1]}", daemon=True
        ).start()
        raise problem

    def _probe(self, key: tuple[str, str, str], down: _Down) -> None:
        try:
            kubernetes.client.VersionApi(down.client).get_code(_request_timeout=self.timeout)
        except Exception as e:
            if unreachable(e):
                with self._lock:
                    down.delay = min(down.delay * 2, BACKOFF_S[1])
                    down.until = time.monotonic() + down.delay
                    down.probing = False
                log.debug("%s: still no answer (%s)", down.problem.message, api_reason(e))
                return
            # Any HTTP answer (even 401) means it is there; what else is wrong, the next
            # reconcile reports.
        with self._lock:
            if self._down.get(key) is down:
                del self._down[key]
        log.info("The cluster of Secret %s/%s answers again", key[0], key[1])


MAX_KUBECONFIG_BYTES: Final = 64 << 10
"""The largest kubeconfig the operator parses (a flattened one with a CA and a client
certificate is a few KiB); a larger one is refused unparsed."""


def _client_from_secret(data: dict[str, str], key: str, where: str) -> ApiClient:
    if key not in data:
        raise ClusterProblem(c.KUBECONFIG_SECRET_INVALID, f"{where} has no key {key!r}")
    if len(data[key] or "") * 3 // 4 > MAX_KUBECONFIG_BYTES:  # base64: 4 characters, 3 bytes
        raise ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID,
            f"{where} key {key!r} is larger than {MAX_KUBECONFIG_BYTES // 1024} KiB, more "
            "than any kubeconfig the operator needs (kubectl config view --raw --flatten "
            "--minify)",
        )
    try:
        config = yaml.safe_load(base64.b64decode(data[key]).decode())
    except (binascii.Error, UnicodeDecodeError, yaml.YAMLError):
        # The parser's message may quote the file; say only where the problem is.
        raise ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID, f"{where} key {key!r} is not a readable kubeconfig"
        ) from None
    if not isinstance(config, dict) or not config.get("clusters"):
        raise ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID, f"{where} key {key!r} is not a kubeconfig (no clusters)"
        )
    try:
        return api_client_from_kubeconfig(config)
    except KubeconfigRefused as e:  # names the field, never its value
        raise ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID, f"{where} key {key!r} is refused: {e}"
        ) from None
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID,
            f"{where} key {key!r} is not a usable kubeconfig ({type(e).__name__})",
        ) from None


def describe_failure(e: BaseException, target: Target, secret_namespace: str) -> ClusterProblem:
    """Turn an API call's failure against a target into a ClusterProblem: a stable message
    (the same every pass, so the status does not churn) that names no credential."""
    where = (
        target.label
        if target.server is not None
        else "this cluster"
        if target.secret is None
        else f"the cluster of Secret {secret_namespace}/{target.secret.name}"
    )
    if isinstance(e, NotKubernetesAPI):
        return ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID,
            f"{where} answered HTTP {e.status} but not as the Kubernetes API: is the "
            "kubeconfig's server the cluster's apiserver?",
        )
    if isinstance(e, ApiException) and e.status in (401, 403):
        return ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID,
            f"{where} refused the credentials (HTTP {e.status} {e.reason})",
        )
    if isinstance(e, ApiException) and e.status:
        return ClusterProblem(c.CLUSTER_UNREACHABLE, f"{where} answered HTTP {e.status} {e.reason}")
    return ClusterProblem(c.CLUSTER_UNREACHABLE, f"{where} did not answer ({api_reason(e)})")


def api_reason(e: BaseException) -> str:
    """A short, secret-free description of a failed call for logs: the HTTP status, or the
    kind of connection failure (never the exception's text, which may quote a header)."""
    if isinstance(e, NotKubernetesAPI):
        return f"HTTP {e.status}, not the Kubernetes API"
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}" if e.status else "TLS or connection error"
    if isinstance(e, urllib3.exceptions.MaxRetryError) and e.reason is not None:
        e = e.reason
    if isinstance(e, urllib3.exceptions.NewConnectionError | ConnectionRefusedError):
        return "could not connect"  # before ConnectTimeoutError: urllib3 derives it from that
    if isinstance(e, urllib3.exceptions.ConnectTimeoutError):
        return "connect timed out"
    if isinstance(e, urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return "timed out"
    return type(e).__name__


def api_message(e: ApiException, limit: int = 300) -> str:
    """The apiserver's own explanation of a refusal (the Status object's message), as a
    ReplicaSet's FailedCreate event quotes it; scrubbed of registered secrets, cut short."""
    message = ""
    try:
        body = json.loads(e.body or "")
        if isinstance(body, dict):
            message = str(body.get("message") or "")
    except (TypeError, ValueError):
        pass
    message = redact.scrub(" ".join((message or f"HTTP {e.status} {e.reason}").split()))
    return message if len(message) <= limit else message[: limit - 3] + "..."


def as_dict(api: ApiClient, obj: Any) -> dict[str, Any]:
    """A client model object as the plain camelCase dict the API would send."""
    out = api.sanitize_for_serialization(obj)
    assert isinstance(out, dict)
    return out
