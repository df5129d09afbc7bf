"""A kubeconfig from a user's Secret, read as data and nothing else.

    api = api_client_from_kubeconfig(config_dict, where="Secret team-a/region-a")

The kubernetes client's own loader runs `exec` credential plugins and `auth-provider`s and
reads `tokenFile`, `client-certificate`, `client-key` and `certificate-authority` paths: fed
a namespace user's Secret, it would run their command as the operator and send the
operator's own files (its ServiceAccount token) wherever they point. So a Secret's
kubeconfig may hold only inline credentials and an explicit server:

    cluster: server (https:// or http://), certificate-authority-data,
             insecure-skip-tls-verify, tls-server-name
    user:    token, or client-certificate-data with client-key-data

Anything else (exec, auth-provider, tokenFile, file paths, proxy-url, impersonation,
username/password) is refused with `KubeconfigRefused`, whose message names the field and
never its value. The client is built directly from those values; the CA and client key go
to private temporary files of ours, never to a path the user chose.

The `server` may be any HTTP service the operator can reach, so the client accepts only
answers of the Kubernetes API (a JSON object; for an error a `Status`): anything else raises
`NotKubernetesAPI`, which carries the HTTP status alone, so the operator never relays an
internal service's answer into a job's status, its events or the log.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import hashlib
import http
import json
import os
import shutil
import tempfile
import threading
from typing import Any, Final

import urllib3
from kubernetes.client import ApiClient, Configuration

from ddiloco.operator import redact

CLUSTER_FIELDS = {
    "server",
    "certificate-authority-data",
    "insecure-skip-tls-verify",
    "tls-server-name",
}
USER_FIELDS = {"token", "client-certificate-data", "client-key-data"}
HARMLESS = {"extensions"}  # metadata the client ignores
# One retry, of a connect that failed; none after a request went out (the client's default is
# three of everything, so a frozen apiserver held a call for four read timeouts).
RETRIES: Final = urllib3.Retry(total=1, connect=1, read=0, status=0, other=0, redirect=0)


class NotKubernetesAPI(urllib3.exceptions.HTTPError):
    """A remote server answered, but not as the Kubernetes API: not JSON, not an object, or
    an error that is no `Status`. Its body, headers and reason phrase are never kept (a
    kubeconfig's `server` may be any service the operator can reach; what it says must not
    reach a status, an event or a log line), only the HTTP status code."""

    def __init__(self, status: int) -> None:
        super().__init__(f"answered HTTP {status}, not as the Kubernetes API")
        self.status = status


def kubernetes_answer(status: int, content_type: str, data: bytes) -> bool:
    """Whether an HTTP answer is what the Kubernetes API sends: a JSON object with a JSON
    content type, and, for a failure, a `Status` object."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        return False
    try:
        body = json.loads(data)
    except (TypeError, ValueError):
        return False
    if not isinstance(body, dict):
        return False
    if 200 <= status < 300:
        return True
    return body.get("kind") == "Status" and body.get("apiVersion") == "v1"


def kubernetes_answers_only(client: ApiClient) -> ApiClient:
    """Make `client` raise NotKubernetesAPI for every answer that is not the Kubernetes
    API's (`kubernetes_answer`), before the client parses or quotes it; the reason phrase of
    an error becomes the standard one for its code."""
    rest = client.rest_client
    request = rest.request

    def checked(*args: Any, **kwargs: Any) -> Any:
        resp = request(*args, **kwargs)
        data = resp.read()
        content_type = str(resp.headers.get("content-type") or "")
        if not kubernetes_answer(resp.status, content_type, data):
            resp.data = b""
            raise NotKubernetesAPI(int(resp.status or 0))
        try:
            resp.reason = http.HTTPStatus(resp.status).phrase
        except ValueError:
            resp.reason = ""
        return resp

    rest.request = checked
    return client


class KubeconfigRefused(ValueError):
    """A kubeconfig this operator will not use; the message names the field, not its value."""


def _named(config: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    for entry in config.get(f"{kind}s") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(kind)
            if not isinstance(body, dict):
                raise KubeconfigRefused(f"{kind} {name!r} has no {kind} map")
            return body
    raise KubeconfigRefused(f"no {kind} named {name!r}")


def _context(config: dict[str, Any]) -> dict[str, Any]:
    contexts = [e for e in config.get("contexts") or [] if isinstance(e, dict)]
    current = config.get("current-context")
    if current:
        return _named(config, "context", str(current))
    if len(contexts) == 1 and isinstance(contexts[0].get("context"), dict):
        return contexts[0]["context"]
    raise KubeconfigRefused("no current-context, and not exactly one context")


def _only(body: dict[str, Any], allowed: set[str], what: str) -> None:
    refused = sorted(set(body) - allowed - HARMLESS)
    if refused:
        raise KubeconfigRefused(
            f"{what} sets {', '.join(refused)}: only inline credentials are accepted "
            f"({', '.join(sorted(allowed))})"
        )


def _b64(value: object, field: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise KubeconfigRefused(f"{field} is not base64") from None


_private_dir: str | None = None
_private_lock = threading.Lock()


def _private_file(data: bytes) -> str:
    """A file holding `data` (a CA, a client certificate or key) for the kubernetes client,
    which reads them by path on every new connection. One directory per process (mode 0700),
    removed when the process exits; a file per distinct content, so reconnecting clients do
    not pile up copies of the same key."""
    global _private_dir
    with _private_lock:
        if _private_dir is None:
            _private_dir = tempfile.mkdtemp(prefix="ddiloco-kube-")
            atexit.register(shutil.rmtree, _private_dir, True)
        path = os.path.join(_private_dir, hashlib.sha256(data).hexdigest()[:32])
        if not os.path.exists(path):
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
    return path


def _register_credentials(config: dict[str, Any]) -> None:
    """Every credential-like value of every user, accepted or not, goes to redact.py first:
    a refused or broken one must not reach a log line either."""
    for entry in config.get("users") or []:
        user = entry.get("user") if isinstance(entry, dict) else None
        if not isinstance(user, dict):
            continue
        for field in ("token", "client-key-data", "client-certificate-data", "password"):
            if isinstance(user.get(field), str):
                redact.register(user[field])


def parse(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (cluster, user) maps of the current context, checked field by field."""
    _register_credentials(config)
    ctx = _context(config)
    _only(ctx, {"cluster", "user", "namespace"}, "context")
    cluster = _named(config, "cluster", str(ctx.get("cluster")))
    user = _named(config, "user", str(ctx.get("user")))
    _only(cluster, CLUSTER_FIELDS, "cluster")
    _only(user, USER_FIELDS, "user")
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigRefused("cluster server must be an explicit https:// (or http://) URL")
    has_cert = "client-certificate-data" in user or "client-key-data" in user
    if has_cert and not {"client-certificate-data", "client-key-data"} <= set(user):
        raise KubeconfigRefused("user needs both client-certificate-data and client-key-data")
    if "token" not in user and not has_cert:
        raise KubeconfigRefused("user has no credentials (token or client certificate data)")
    if "token" in user:
        token = str(user["token"]).strip()
        if not token or not token.isascii() or not token.isprintable() or " " in token:
            raise KubeconfigRefused("user token is not a single printable ASCII word")
        user = {**user, "token": token}
    return cluster, user


def api_client_from_kubeconfig(config: dict[str, Any]) -> ApiClient:
    """A client for the current context's cluster, from inline credentials only."""
    cluster, user = parse(config)
    cfg = Configuration()
    cfg.retries = RETRIES
    cfg.host = cluster["server"].rstrip("/")
    cfg.verify_ssl = not bool(cluster.get("insecure-skip-tls-verify", False))
    if "certificate-authority-data" in cluster:
        ca = _b64(cluster["certificate-authority-data"], "certificate-authority-data")
        cfg.ssl_ca_cert = _private_file(ca)
    if "tls-server-name" in cluster:
        cfg.tls_server_name = str(cluster["tls-server-name"])
    if "token" in user:
        cfg.api_key = {"authorization": f"Bearer {user['token']}"}
    if "client-certificate-data" in user:
        cfg.cert_file = _private_file(
            _b64(user["client-certificate-data"], "client-certificate-data")
        )
        cfg.key_file = _private_file(_b64(user["client-key-data"], "client-key-data"))
    return kubernetes_answers_only(ApiClient(cfg))
