"""`ddiloco status --job NAME`: a job's synchronizer status through the Kubernetes API.

    source = JobSource(args)        # args of cli/status.py: job, namespace, context, kubeconfig
    snap = source.fetch()           # the synchronizer's /v1/status, or the job's CR status

With your kubeconfig it reads the DecoupledDiLoCoJob (404: exit 2), the bearer token from the
job's token Secret (`<job>-token`, key `token`, operator/builders.py), and GET /v1/status from
each Running synchronizer pod of its StatefulSet through a port-forward (pods/portforward, as
`kubectl port-forward`): with synchronizer.shards S > 1 from every shard's pod (found by its
pod-index label), merged into the job's view (`ddiloco.wire.job_status.merge_statuses`).

Why not the apiserver's service proxy (`.../services/<job>-synchronizer:8470/proxy/v1/status`):
the apiserver authenticates the caller by the Authorization header and removes it before it
proxies (kubernetes/kubernetes#38775), so the synchronizer never sees the job's bearer token and
answers 401. A port-forward carries bytes, so the request, TLS included, is the synchronizer's
own: the server certificate is verified against the job's CA (`<job>-trust`, or `--ca`) under
the Service's DNS name (a shard's headless name with S > 1).

When that is refused (no RBAC to read the Secret or to port-forward, a shard without a Running
pod, mutual TLS and no `--client-cert`, a shard that does not answer) the snapshot is the job's own
status, which the operator fills from the same endpoint (global version, goodput, merged work,
live learners, conditions), with a one-line note that says what was refused.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import socket
import ssl
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ddiloco.cli.errors import RuntimeFailure, UsageError, one_line
from ddiloco.cli.status import Snapshot, explain_http, parse_status, read_token, tls_context


class _Refused(Exception):
    """The synchronizer's own status is out of reach: show the job's status instead."""


class JobSource:
    """Snapshots of one job: the synchronizer's status when reachable, else its CR status."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            from kubernetes import client, config
            from kubernetes.config.config_exception import ConfigException
        except ImportError:
            raise UsageError(
                "--job needs the kubernetes package: pip install 'decoupled-diloco[operator]'"
            ) from None
        try:
            config.load_kube_config(config_file=args.kubeconfig, context=args.context)
            _, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
        except (ConfigException, OSError) as e:
            raise UsageError(f"kubeconfig: {one_line(e)}") from None
        if args.context:
            contexts, _ = config.list_kube_config_contexts(config_file=args.kubeconfig)
            active = next((c for c in contexts if c.get("name") == args.context), active)
        self.namespace = args.namespace or (active or {}).get("context", {}).get(
            "namespace", "default"
        )
        self.name: str = args.job
        self.args = args
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.timeout = args.timeout

    @property
    def where(self) -> str:
        return f"job {self.namespace}/{self.name}"

    def _job(self) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        from ddiloco.operator import api as ddapi

        try:
            body = self.custom.get_namespaced_custom_object(
                ddapi.GROUP,
                ddapi.VERSION,
                self.namespace,
                ddapi.PLURAL,
                self.name,
                _request_timeout=self.timeout,
            )
        except ApiException as e:
            if e.status == 404:
                raise UsageError(f"{self.where} not found") from None
            if e.status in (401, 403):
                raise UsageError(f"{self.where}: the apiserver refused: {e.reason}") from None
            raise RuntimeFailure(f"{self.where}: the apiserver answered {e.status}") from None
        except Exception as e:  # urllib3's connection errors: the apiserver is out of reach
            raise RuntimeFailure(f"cannot reach the apiserver: {one_line(e)}") from None
        return dict(body)

    def fetch(self) -> Snapshot:
        from ddiloco.operator import api as ddapi

        body = self._job()
        try:
            job = ddapi.DecoupledDiLoCoJob.from_body(body)
            raw = self._through_pod(job)
        except _Refused as e:
            note = f"showing the job's status, not the synchronizer's: {e}"
            return Snapshot(dict(body.get("status") or {}), self.where, note, is_job_status=True)
        except ValueError as e:  # a job this version cannot read
            note = f"showing the job's status: its spec does not parse ({one_line(e)})"
            return Snapshot(dict(body.get("status") or {}), self.where, note, is_job_status=True)
        return Snapshot(raw, self.where)

    def _secret(self, name: str, key: str) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.core.read_namespaced_secret(
                name, self.namespace, _request_timeout=self.timeout
            )
        except ApiException as e:
            raise _Refused(f"cannot read Secret {self.namespace}/{name}: {e.reason}") from None
        data = (secret.data or {}).get(key)
        if not data:
            raise _Refused(f"Secret {self.namespace}/{name} has no {key!r}")
        return base64.b64decode(data).decode()

    def _pods(self, job: Any) -> list[str]:
        """The Running synchronizer pod of each shard, in shard order."""
        from kubernetes.client.exceptions import ApiException

        from ddiloco.operator import builders

        selector = f"{builders.LABEL_JOB_UID}={job.uid},{builders.LABEL_COMPONENT}=synchronizer"
        try:
            pods = self.core.list_namespaced_pod(
                self.namespace,
                label_selector=selector,
                field_selector="status.phase=Running",
                _request_timeout=self.timeout,
            ).items
        except ApiException as e:
            raise _Refused(f"cannot list the synchronizer's pods: {e.reason}") from None
        shards = job.spec.synchronizer.shards
        if shards == 1:
            if not pods:
                raise _Refused("no Running synchronizer pod")
            return [str(pods[0].metadata.name)]
        by_shard = {(p.metadata.labels or {}).get(builders.LABEL_POD_INDEX): p for p in pods}
        missing = [str(i) for i in range(shards) if str(i) not in by_shard]
        if missing:
            raise _Refused(f"no Running synchronizer pod for shard {', '.join(missing)}")
        return [str(by_shard[str(i)].metadata.name) for i in range(shards)]

    def _tls(self, job: Any) -> ssl.SSLContext | None:
        from ddiloco.operator import builders

        tls = job.spec.synchronizer.tls
        if not tls.enabled:
            return None
        a = self.args
        if tls.mutual and a.client_cert is None:
            raise _Refused("it requires a client certificate (mutual TLS): give --client-cert")
        if a.ca is not None:
            return tls_context(a.ca, a.client_cert, a.client_key)
        ca_pem = self._secret(builders.trust_secret_name(job), builders.CA_KEY)
        ctx = tls_context(None, a.client_cert, a.client_key)
        ctx.load_verify_locations(cadata=ca_pem)
        return ctx

    @staticmethod
    def _hostname(job: Any, shard: int) -> str:
        """The name shard `shard` is verified under: in its certificate (builders.py)."""
        from ddiloco.operator import builders

        if job.spec.synchronizer.shards == 1:
            return builders.service_dns_names(job)[2]  # <svc>.<ns>.svc
        return str(builders.shard_host(job, shard))

    def _through_pod(self, job: Any) -> dict[str, Any]:
        from ddiloco.operator import builders, tokens

        token = read_token(self.args.token_file) if self.args.token_file else None
        if token is None:
            token = tokens.current(
                self._secret(builders.token_secret_name(job), builders.TOKEN_KEY)
            )
        if not token:
            raise _Refused("the job's token Secret holds no token")
        context = self._tls(job)
        answers = [
            self._ask(pod, context, self._hostname(job, i), token)
            for i, pod in enumerate(self._pods(job))
        ]
        if len(answers) == 1:
            return answers[0]
        from ddiloco.wire.job_status import merge_statuses
        from ddiloco.wire.protocol import Status

        merged = merge_statuses([Status.model_validate(a) for a in answers])
        return dict(merged.model_dump(mode="json"))

    def _ask(
        self, pod: str, context: ssl.SSLContext | None, hostname: str, token: str
    ) -> dict[str, Any]:
        """GET /v1/status of one synchronizer pod through a port-forward."""
        from ddiloco.operator import builders

        sock = self._forward(pod, builders.SYNC_PORT)
        where = f"{self.where} (pod {pod})"
        try:
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=hostname)
            conn = http.client.HTTPConnection(hostname, builders.SYNC_PORT, timeout=self.timeout)
            conn.sock = sock
            conn.request("GET", "/v1/status", headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise _Refused(f"no answer through the port-forward to {pod}: {one_line(e)}") from None
        finally:
            sock.close()
        if resp.status != 200:
            raise _Refused(one_line(explain_http(where, resp.status, raw)))
        try:
            return parse_status(raw, where)
        except UsageError as e:
            raise _Refused(str(e)) from None

    def _forward(self, pod: str, port: int) -> socket.socket:
        from kubernetes.stream import portforward

        try:
            pf = portforward(
                self.core.connect_get_namespaced_pod_portforward,
                pod,
                self.namespace,
                ports=str(port),
                _request_timeout=self.timeout,
            )
            sock: socket.socket = pf.socket(port)
        except Exception as e:  # ApiException, a websocket handshake refused, a timeout
            raise _Refused(f"port-forward to pod {pod} refused: {one_line(e)}") from None
        sock.settimeout(self.timeout)
        return sock


def job_status_view(status: dict[str, Any], *, note: str = "", stale: str = "") -> Group:
    """The job's CR status (camelCase, as the apiserver serves it) as a table."""
    title = "ddiloco status  (the job's status)"
    if stale:
        title += f"  [{stale}]"
    t = Table(title="job status", title_justify="left")
    t.add_column("field")
    t.add_column("value", justify="right")
    sync = status.get("synchronizer") or {}
    rows = [
        ("phase", status.get("phase")),
        ("global version", status.get("globalVersion")),
        ("merges", status.get("merges")),
        ("tokens merged", status.get("tokensMerged")),
        ("goodput", _fmt(status.get("goodput"))),
        ("merged-work ratio", _fmt(status.get("mergedWorkRatio"))),
        ("learners live / ready / desired", _triple(status)),
        ("unhealthy slots", status.get("unhealthySlots")),
        ("synchronizer ready / reachable", f"{sync.get('ready')} / {sync.get('reachable')}"),
    ]
    for cond in status.get("conditions") or []:
        rows.append((f"condition {cond.get('type')}", f"{cond.get('status')} {cond.get('reason')}"))
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    parts: list[Text | Table] = [Text(title, style="bold")]
    if note:
        parts.append(Text(note))
    parts.append(t)
    return Group(*parts)


def _fmt(value: Any) -> str | None:
    return f"{value:.3f}" if isinstance(value, (int, float)) else None


def _triple(status: dict[str, Any]) -> str:
    keys = ("liveLearners", "readyLearners", "desiredLearners")
    return " / ".join("-" if status.get(k) is None else str(status[k]) for k in keys)
