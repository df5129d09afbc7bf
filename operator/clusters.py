"""API clients for the clusters a job spans: the operator's own, and remote ones.

    clusters = Clusters(home_api_client(), request_timeout=10)
    api = clusters.client(target, secret_namespace="team-a")    # raises ClusterProblem

A learner group in another cluster or region names a Secret, in the job's namespace, holding a
kubeconfig for it (key `kubeconfig` unless the group says otherwise). The client built from it
is cached by the Secret's resourceVersion, so editing the Secret takes effect on the next
reconcile. A Secret that is missing or unusable raises `ClusterProblem`, which reconcile turns
into a Degraded condition naming the Secret. Kubeconfig contents never reach a log line or a
status message: problems say which Secret and what kind of problem, nothing more. Only inline
credentials are accepted (operator/kubeconfig.py): the operator never runs a Secret's exec
plugin nor reads a file it names.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
from dataclasses import dataclass
from typing import Any, Final

import kubernetes
import yaml
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from ddiloco.operator import conditions as c
from ddiloco.operator.kubeconfig import KubeconfigRefused, api_client_from_kubeconfig
from ddiloco.operator.plan import Target

log = logging.getLogger(__name__)

UNREACHABLE_ERRORS: Final = (OSError, kubernetes.client.exceptions.OpenApiException)


class ClusterProblem(Exception):
    """A cluster that cannot be used now; `reason` is a Degraded condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def home_api_client() -> ApiClient:
    """The operator's own cluster: in-cluster credentials, else $KUBECONFIG / ~/.kube/config."""
    cfg = Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    return ApiClient(cfg)


@dataclass
class _Cached:
    version: str
    client: ApiClient


class Clusters:
    """Clients per target; thread-safe (kopf runs sync handlers in a thread pool)."""

    def __init__(self, home: ApiClient) -> None:
        self.home = home
        self._cache: dict[tuple[str, str, str], _Cached] = {}
        self._lock = threading.Lock()

    def client(self, target: Target, secret_namespace: str, allow_stale: bool = False) -> ApiClient:
        """The client for a target. With allow_stale, a vanished Secret's last client is used
        (cleanup during a namespace deletion, when the Secret may go before the job)."""
        if target.secret is None:
            return self.home
        ref = target.secret
        key = (secret_namespace, ref.name, ref.key)
        where = f"Secret {secret_namespace}/{ref.name}"
        try:
            secret = kubernetes.client.CoreV1Api(self.home).read_namespaced_secret(
                ref.name, secret_namespace
            )
        except ApiException as e:
            if e.status == 404:
                with self._lock:
                    cached = self._cache.get(key)
                if allow_stale and cached is not None:
                    return cached.client
                raise ClusterProblem(
                    c.KUBECONFIG_SECRET_MISSING, f"{where} was not found"
                ) from None
            raise
        version = secret.metadata.resource_version or ""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.version == version:
                return cached.client
        client = _client_from_secret(secret.data or {}, ref.key, where)
        with self._lock:
            old = self._cache.pop(key, None)
            self._cache[key] = _Cached(version, client)
        if old is not None:
            old.client.close()
            log.info("Reloaded kubeconfig from %s", where)
        return client


def _client_from_secret(data: dict[str, str], key: str, where: str) -> ApiClient:
    if key not in data:
        raise ClusterProblem(c.KUBECONFIG_SECRET_INVALID, f"{where} has no key {key!r}")
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
    """Turn an API call's failure against a remote target into a ClusterProblem."""
    where = (
        "this cluster"
        if target.secret is None
        else f"the cluster of Secret {secret_namespace}/{target.secret.name}"
    )
    if isinstance(e, ApiException) and e.status in (401, 403):
        return ClusterProblem(
            c.KUBECONFIG_SECRET_INVALID,
            f"{where} refused the credentials (HTTP {e.status} {e.reason})",
        )
    if isinstance(e, ApiException) and e.status:
        return ClusterProblem(c.CLUSTER_UNREACHABLE, f"{where} answered HTTP {e.status} {e.reason}")
    return ClusterProblem(c.CLUSTER_UNREACHABLE, f"{where} did not answer ({type(e).__name__})")


def api_reason(e: BaseException) -> str:
    """A short, secret-free description of a failed call for logs."""
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return type(e).__name__


def as_dict(api: ApiClient, obj: Any) -> dict[str, Any]:
    """A client model object as the plain camelCase dict the API would send."""
    out = api.sanitize_for_serialization(obj)
    assert isinstance(out, dict)
    return out
