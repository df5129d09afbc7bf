"""Whether every object a job derives has a name (and labels) its apiserver accepts.

    problems = names.problems(job)      # [] or sentences naming the object and the rule

The CRD refuses what it can (metadata.name a DNS-1035 label of at most api.MAX_JOB_NAME
characters, group names DNS labels of at most api.MAX_GROUP_NAME), and
tests/unit/test_operator_names.py checks that the longest job, group and index those limits
allow still give valid names. This module checks the names themselves, as builders.py makes
them, so a job the CRD let through (an older CRD, a changed naming function) is refused with
an InvalidSpec condition that names the object instead of being half made: a Service
refused while the job reports Ready.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Final

from ddiloco.operator import builders
from ddiloco.operator.api import DecoupledDiLoCoJob

# The apiserver's rules (k8s.io/apimachinery/pkg/util/validation).
DNS1035_LABEL: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
LABEL_VALUE: Final = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def dns1035_label(name: str) -> str | None:
    """None if valid, else what is wrong: the rule of Service names."""
    if len(name) > 63:
        return f"is {len(name)} characters, more than 63"
    if not DNS1035_LABEL.match(name):
        return "must be lower-case letters, digits and '-', start with a letter, end alphanumeric"
    return None


def dns1123_label(name: str) -> str | None:
    if len(name) > 63:
        return f"is {len(name)} characters, more than 63"
    if not DNS1123_LABEL.match(name):
        return "must be lower-case letters, digits and '-', start and end alphanumeric"
    return None


def dns1123_subdomain(name: str) -> str | None:
    """The rule of most object names (Secrets, PVCs, Deployments, Pods)."""
    if len(name) > 253:
        return f"is {len(name)} characters, more than 253"
    if not DNS1123_SUBDOMAIN.match(name):
        return "must be lower-case letters, digits, '-' and '.', start and end alphanumeric"
    return None


def label_value(value: str) -> str | None:
    if len(value) > 63:
        return f"is {len(value)} characters, more than 63"
    if not LABEL_VALUE.match(value):
        return "must be letters, digits, '-', '_' and '.', start and end alphanumeric"
    return None


def statefulset_name(name: str) -> str | None:
    """A StatefulSet labels its pods `controller-revision-hash: <name>-<hash>`, the hash up
    to 10 characters: a label value of at most 63 characters leaves 52 for the name."""
    if len(name) > 52:
        return f"is {len(name)} characters, more than 52 (its pods' revision label)"
    return dns1123_subdomain(name)


Rule = Callable[[str], str | None]


def derived(job: DecoupledDiLoCoJob) -> Iterator[tuple[str, str, Rule]]:
    """(what, name, rule) of every name the job's objects get; per group, at its highest
    index (the longest name) and index 0."""
    yield "Service", builders.synchronizer_name(job), dns1035_label
    yield "Service", builders.shards_service_name(job), dns1035_label
    yield "StatefulSet", builders.synchronizer_name(job), statefulset_name
    last = job.spec.synchronizer.shards - 1
    yield "Pod", builders.shard_pod_name(job, last), dns1123_label  # its hostname
    yield "PersistentVolumeClaim", builders.shard_claim_name(job, last), dns1123_subdomain
    yield "Secret", builders.token_secret_name(job), dns1123_subdomain
    for fn in ("ca_secret_name", "tls_secret_name", "trust_secret_name"):
        if hasattr(builders, fn):
            yield "Secret", getattr(builders, fn)(job), dns1123_subdomain
    if hasattr(builders, "certificate_name"):
        yield "Certificate", builders.certificate_name(job), dns1123_subdomain
    for label, value in builders.labels(job, "synchronizer").items():
        yield f"label {label}", value, label_value
    for group in job.spec.learner_groups:
        for index in sorted({0, max(group.replicas - 1, 0)}):
            pod = builders.build_learner_pod(job, group, index)
            name = pod["metadata"]["name"]
            yield "Pod", name, dns1123_subdomain
            if hasattr(builders, "client_secret_name"):
                secret = builders.client_secret_name(job, group.name, index)
                yield "Secret", secret, dns1123_subdomain
            for label, value in pod["metadata"]["labels"].items():
                yield f"learner pod {name}: label {label}", value, label_value
        yield "Secret", builders.learner_tokens_secret_name(job, group.name), dns1123_subdomain
        hot = job.spec.failure_policy.hot_spares
        if hot:  # hot spares (spares.py): serials stay below replicas + 2 hotSpares
            serial = group.replicas + 2 * hot
            pod = builders.build_spare_pod(job, group, serial)
            name = pod["metadata"]["name"]
            yield "Pod", name, dns1123_subdomain
            secret = builders.spare_client_secret_name(job, group.name, serial)
            yield "Secret", secret, dns1123_subdomain
            for label, value in pod["metadata"]["labels"].items():
                yield f"spare pod {name}: label {label}", value, label_value
        if group.cluster is not None and group.cluster.namespace:
            yield "namespace", group.cluster.namespace, dns1123_label


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """Sentences, one per name the apiserver would refuse."""
    out: list[str] = []
    why = dns1035_label(job.name)
    if why:
        out.append(f"metadata.name {job.name!r} {why} (it names the synchronizer Service)")
    for what, name, rule in derived(job):
        why = rule(name)
        if why:
            out.append(f"{what} {name!r} {why}")
    return list(dict.fromkeys(out))
