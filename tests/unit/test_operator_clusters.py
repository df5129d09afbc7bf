"""Kubeconfig Secrets to API clients (ddiloco.operator.clusters), and the settings module.

    .venv/bin/pytest tests/unit/test_operator_clusters.py

What a broken Secret turns into matters: a Degraded reason naming the Secret, and never a
line of its contents in a message.
"""

from __future__ import annotations

import base64

import pytest
import yaml

from ddiloco.operator import conditions as c
from ddiloco.operator.clusters import ClusterProblem, _client_from_secret
from ddiloco.operator.config import OperatorSettings

SECRET_TEXT = "hunter2-do-not-print"
WHERE = "Secret ns/region-a-kubeconfig"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kubeconfig(server: str = "https://10.1.2.3:6443") -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "x",
            "clusters": [
                {"name": "x", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": "x", "user": {"token": SECRET_TEXT}}],
            "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
        }
    )


def test_a_valid_kubeconfig_becomes_a_client() -> None:
    client = _client_from_secret({"kubeconfig": b64(kubeconfig())}, "kubeconfig", WHERE)
    assert client.configuration.host == "https://10.1.2.3:6443"
    client.close()


@pytest.mark.parametrize(
    ("data", "key", "needle"),
    [
        ({"other": b64(kubeconfig())}, "kubeconfig", "has no key 'kubeconfig'"),
        (
            {"kubeconfig": b64(f"clusters: [{SECRET_TEXT}: oops")},
            "kubeconfig",
            "not a readable kubeconfig",
        ),
        ({"kubeconfig": "%%%not-base64"}, "kubeconfig", "not a readable kubeconfig"),
        ({"kubeconfig": b64(f"just: {SECRET_TEXT}")}, "kubeconfig", "not a kubeconfig"),
        (
            {
                "kubeconfig": b64(
                    kubeconfig().replace("current-context: x", "current-context: nope")
                )
            },
            "kubeconfig",
            "no context named 'nope'",
        ),
    ],
)
def test_broken_secrets_name_the_secret_and_hide_the_content(
    data: dict[str, str], key: str, needle: str
) -> None:
    with pytest.raises(ClusterProblem) as err:
        _client_from_secret(data, key, WHERE)
    assert err.value.reason == c.KUBECONFIG_SECRET_INVALID
    assert WHERE in err.value.message and needle in err.value.message
    assert SECRET_TEXT not in err.value.message


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_OPERATOR_NAMESPACES", "a, b,,")
    monkeypatch.setenv("DDILOCO_OPERATOR_RESYNC_SECONDS", "0.5")
    cfg = OperatorSettings()
    assert cfg.namespace_list() == ["a", "b"] and cfg.resync_seconds == 0.5
    assert cfg.watch_server_timeout < cfg.watch_client_timeout  # the server ends it first
    # kopf sends it as ?timeoutSeconds=; the apiserver answers 400 to "300.0"
    assert isinstance(cfg.watch_server_timeout, int)
    monkeypatch.setenv("DDILOCO_OPERATOR_STATUS_URL_TEMPLATE", "http://{nope}")
    with pytest.raises(ValueError, match="name"):
        OperatorSettings()
