"""A user's kubeconfig Secret is data: no exec plugin runs, no file it names is read.

    pytest tests/unit/test_operator_kubeconfig.py

Each refused field is its own case; the accepted shapes build a client with the inline
credentials; the refusals name the field and never its value.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddiloco.operator import conditions as c
from ddiloco.operator.clusters import ClusterProblem, _client_from_secret
from ddiloco.operator.kubeconfig import KubeconfigRefused, api_client_from_kubeconfig, parse

SECRET = "s3cr3t-value-never-printed"
WHERE = "Secret team-a/region-a"


def config(cluster: dict[str, Any] | None = None, user: dict[str, Any] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "r",
        "clusters": [{"name": "r", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "r", "user": user if user is not None else {"token": SECRET}}],
        "contexts": [{"name": "r", "context": {"cluster": "r", "user": "r"}}],
    }


def secret_of(cfg: dict) -> dict[str, str]:
    return {"kubeconfig": base64.b64encode(yaml.safe_dump(cfg).encode()).decode()}


def test_exec_plugins_never_run(tmp_path: Path) -> None:
    owned = tmp_path / "owned"
    plugin = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            "args": ["-c", f'id > {owned}; echo \'{{"status": {{"token": "x"}}}}\''],
        }
    }
    with pytest.raises(ClusterProblem) as err:
        _client_from_secret(secret_of(config(user=plugin)), "kubeconfig", WHERE)
    assert err.value.reason == c.KUBECONFIG_SECRET_INVALID
    assert "exec" in err.value.message and WHERE in err.value.message
    assert not owned.exists()  # the command was never run


@pytest.mark.parametrize(
    ("where", "field", "value"),
    [
        ("user", "tokenFile", "/var/run/secrets/kubernetes.io/serviceaccount/token"),
        ("user", "client-certificate", "/etc/ssl/private/operator.crt"),
        ("user", "client-key", "/etc/ssl/private/operator.key"),
        ("user", "auth-provider", {"name": "oidc", "config": {"cmd-path": "/bin/sh"}}),
        ("user", "as", "system:admin"),
        ("user", "as-groups", ["system:masters"]),
        ("user", "username", "admin"),
        ("user", "password", SECRET),
        (
            "cluster",
            "certificate-authority",
            "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
        ),
        ("cluster", "proxy-url", "http://attacker.example:3128"),
    ],
)
def test_file_based_and_indirect_credentials_are_refused(
    where: str, field: str, value: object
) -> None:
    cfg = config()
    body = cfg["users" if where == "user" else "clusters"][0][where]
    body[field] = copy.deepcopy(value)
    with pytest.raises(ClusterProblem) as err:
        _client_from_secret(secret_of(cfg), "kubeconfig", WHERE)
    msg = err.value.message
    assert err.value.reason == c.KUBECONFIG_SECRET_INVALID
    assert field in msg and "only inline credentials" in msg
    assert SECRET not in msg and str(value) not in msg


@pytest.mark.parametrize(
    ("cluster", "user", "needle"),
    [
        ({"server": "10.0.0.1:6443"}, {"token": "t"}, "explicit https://"),
        ({"server": "https://10.0.0.1"}, {}, "no credentials"),
        ({"server": "https://10.0.0.1"}, {"client-certificate-data": "eA=="}, "both"),
        ({"server": "https://10.0.0.1"}, {"token": "two words"}, "printable ASCII word"),
        ({"server": "https://10.0.0.1"}, {"token": "line\nbreak"}, "printable ASCII word"),
    ],
)
def test_incomplete_or_malformed_kubeconfigs_are_refused(
    cluster: dict, user: dict, needle: str
) -> None:
    with pytest.raises(KubeconfigRefused, match=needle):
        parse(config(cluster, user))


def test_a_token_with_a_trailing_newline_is_trimmed_not_sent_as_is() -> None:
    client = api_client_from_kubeconfig(config(user={"token": f"{SECRET}\n"}))
    assert client.configuration.api_key == {"authorization": f"Bearer {SECRET}"}
    client.close()


def test_inline_ca_and_client_certificate_go_to_private_files_of_ours() -> None:
    ca, crt, key = b"CA PEM", b"CERT PEM", b"KEY PEM"
    enc = lambda b: base64.b64encode(b).decode()  # noqa: E731
    client = api_client_from_kubeconfig(
        config(
            {"server": "https://10.0.0.1:6443/", "certificate-authority-data": enc(ca)},
            {"client-certificate-data": enc(crt), "client-key-data": enc(key)},
        )
    )
    cfg = client.configuration
    assert cfg.host == "https://10.0.0.1:6443" and cfg.verify_ssl
    for path, data in ((cfg.ssl_ca_cert, ca), (cfg.cert_file, crt), (cfg.key_file, key)):
        assert Path(path).read_bytes() == data
        assert Path(path).stat().st_mode & 0o077 == 0  # not readable by others
    assert not cfg.api_key


def test_credential_files_are_shared_per_content_and_removed_when_the_process_exits(
    tmp_path: Path,
) -> None:
    """The operator builds a client per remote cluster again and again: the same key must not
    pile up in /tmp, and none may outlive the process that wrote it."""
    probe = f"""
import base64, os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_operator_kubeconfig import config
from ddiloco.operator.kubeconfig import api_client_from_kubeconfig
enc = lambda b: base64.b64encode(b).decode()
paths = set()
for _ in range(5):
    c = api_client_from_kubeconfig(config(user={{"client-certificate-data": enc(b"C"), "client-key-data": enc(b"K")}}))
    paths |= {{c.configuration.cert_file, c.configuration.key_file}}
    c.close()
d = {{os.path.dirname(p) for p in paths}}
assert len(paths) == 2 and len(d) == 1, paths
assert os.stat(d.pop()).st_mode & 0o077 == 0
print("\\n".join(sorted(paths)))
"""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    written = out.stdout.split()
    assert len(written) == 2 and all(p.startswith(str(tmp_path)) for p in written)
    assert not any(Path(p).exists() for p in written)
    assert list(tmp_path.iterdir()) == []
