"""Every knob of the operator, read from DDILOCO_OPERATOR_* environment variables.

    DDILOCO_OPERATOR_NAMESPACES=team-a,team-b ddiloco operator    # watch two namespaces
    ddiloco operator --all-namespaces                              # or the whole cluster

`get_settings()` is cached; tests override by setting the environment before they start the
operator process (or call `get_settings.cache_clear()`).
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DDILOCO_OPERATOR_", extra="ignore", use_attribute_docstrings=True
    )

    namespaces: str = ""
    """Comma-separated namespaces to watch; empty watches every namespace."""
    resync_seconds: float = Field(2.0, gt=0, le=300)
    """Interval of the per-job reconcile timer. It bounds how long a failed learner pod in a
    remote cluster (which kopf does not watch) waits to be noticed."""
    status_poll_seconds: float = Field(10.0, gt=0)
    """How often the synchronizer's /v1/status is read for the job status."""
    status_url_template: str = "{scheme}://{name}-synchronizer.{namespace}.svc:8470"
    """Where the operator reads a job's synchronizer status; {name} and {namespace} are the
    job's, {scheme} https with TLS on (verified against the job's CA) else http. Override when
    the operator runs outside the cluster (tests, development)."""
    shard_url_template: str = (
        "{scheme}://{name}-synchronizer-{shard}.{name}-synchronizer-shards.{namespace}.svc:8470"
    )
    """Where the operator reads the status of shard {shard} of a job with
    synchronizer.shards > 1 (the shard pod's headless-Service name by default); the job
    status merges every shard's answer. Placeholders as status_url_template, plus {shard}."""
    http_timeout_seconds: float = Field(3.0, gt=0)
    """Timeout of one request to a synchronizer's status endpoint."""
    api_timeout_seconds: float = Field(10.0, gt=0)
    """Timeout of one Kubernetes API request, so an unreachable remote cluster cannot stall
    a reconcile."""
    cleanup_timeout_seconds: float = Field(120.0, ge=0)
    """How long deleting a job waits for an unreachable cluster before giving up on it."""
    liveness_endpoint: str = "http://0.0.0.0:8080/healthz"
    """kopf's liveness probe endpoint; empty disables it."""
    metrics_port: int = Field(8081, ge=0, le=65535)
    """Port of the operator's Prometheus endpoint (GET /metrics: reconciles, replacements by
    cause, time to replace; operator/metrics.py); 0 or empty turns it off."""
    metrics_address: str = "0.0.0.0"
    """Address the metrics endpoint listens on (127.0.0.1 keeps it to the machine)."""
    standalone: bool = True
    """Run without kopf peering (one operator replica; the chart runs exactly one)."""
    workers: int = Field(8, ge=1, le=128)
    """Threads for the sync handlers (one reconcile per job at a time)."""
    # Watch timeouts, so that the operator never goes silently blind: a watch stream that a
    # load balancer or apiserver drops without a FIN would otherwise hang forever
    # (nolar/kopf#585, the reason dask-kubernetes sets these too).
    watch_server_timeout: int = Field(300, gt=0)
    """Ask the apiserver to end each watch after this many seconds (kopf reconnects). An
    integer: kopf sends it as `timeoutSeconds`, and the apiserver refuses "300.0" with a 400."""
    watch_client_timeout: float = Field(330.0, gt=0)
    """Give up on a watch request after this many seconds, should the server not end it."""
    watch_connect_timeout: float = Field(30.0, gt=0)
    """Timeout to open a watch connection."""
    watch_inactivity_timeout: float = Field(90.0, gt=0)
    """Reconnect a watch that sent nothing, not even a bookmark, for this long."""
    log_level: str = "INFO"
    """Python logging level of the operator."""

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _port(cls, v: object) -> object:
        return 0 if isinstance(v, str) and not v.strip() else v

    @field_validator("status_url_template")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            v.format(name="x", namespace="y", scheme="https")
        except (KeyError, IndexError) as e:
            raise ValueError(
                f"may use only {{name}}, {{namespace}} and {{scheme}}, not {e}"
            ) from None
        return v

    @field_validator("shard_url_template")
    @classmethod
    def _shard_template(cls, v: str) -> str:
        try:
            v.format(name="x", namespace="y", scheme="https", shard=0)
        except (KeyError, IndexError) as e:
            raise ValueError(
                f"may use only {{name}}, {{namespace}}, {{scheme}} and {{shard}}, not {e}"
            ) from None
        return v

    def namespace_list(self) -> list[str]:
        return [n.strip() for n in self.namespaces.split(",") if n.strip()]


@lru_cache(maxsize=1)
def get_settings() -> OperatorSettings:
    return OperatorSettings()
