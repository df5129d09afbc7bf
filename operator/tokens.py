"""The job key, the learners' credentials derived from it, and rotating both without
restarting a pod.

    kubectl annotate ddj my-job ddiloco.dev/rotate-token="$(date +%s)" --overwrite

Who holds what (wire/auth.py says what each credential may do). The job key, Secret
`<job>-token`, lives in the home namespace only: the synchronizer mounts it and the operator
uses it for its own requests (status, spare assignments). Each learner group gets a Secret of
credentials derived from it (`builders.learner_tokens_secret_name`), in the group's cluster:
one item per learner id (`learner:<id>:<mac>`, which speaks for that id alone) and one per hot
spare pod (`spare:<pod>:<mac>`, which reads only that pod's assignment). A pod mounts its own
item and nothing else, so no remote cluster, and no learner, holds the key.

Pure, like reconcile.py: `token_plan(job, obs, fresh)` says what the home key Secret should
hold and which write gets it there; `credentials_action` what a group's credentials Secret
should hold, one line per key line (`auth.derived_lines`), so it follows the key through a
rotation. A rotation is asked for by giving the job's annotation `ddiloco.dev/rotate-token` a
value the operator has not acted on yet (any string; a date is handy). Then:

1. The home Secret `<job>-token` becomes "new\\nold" and records the request in its own
   annotations (`ddiloco.dev/token-rotation`: the value acted on, `ddiloco.dev/token-rotated-at`:
   when); in the same pass every group's credentials get a line per key too, the new one
   first. The synchronizer accepts every line of its key file, so a credential derived from
   either key; learners send their first line. Both re-read the mounted file when the kubelet
   updates it (learners also on a 401), so nothing restarts.
2. Once `spec.synchronizer.tokenRotationGraceSeconds` have passed and every group's
   credentials Secret holds the two lines (a cluster that cannot be reached keeps the old key
   accepted rather than locking its learners out), the key becomes "new" alone, and the
   credentials with it.

The state lives in the key Secret's annotations, so an operator restart mid-rotation carries on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from ddiloco.operator import builders, evaluator_workload
from ddiloco.operator.api import DecoupledDiLoCoJob, LearnerGroup
from ddiloco.operator.plan import (
    Action,
    ClusterView,
    Event,
    Observed,
    Target,
    home,
    iso,
    place,
    status_targets,
    target_of,
    target_of_group,
)
from ddiloco.operator.spares import serials_wanted
from ddiloco.wire.auth import derived_lines

ANNOTATION_ROTATE: Final = "ddiloco.dev/rotate-token"  # on the job: ask for a rotation
ANNOTATION_ROTATION: Final = "ddiloco.dev/token-rotation"  # on the Secret: request acted on
ANNOTATION_ROTATED_AT: Final = "ddiloco.dev/token-rotated-at"  # on the Secret: when


def lines(token: str | None) -> list[str]:
    """The tokens a token Secret holds, newest first."""
    return [x.strip() for x in (token or "").splitlines() if x.strip()]


def current(token: str | None) -> str | None:
    """The token to send (the first line), e.g. for the operator's own status requests."""
    found = lines(token)
    return found[0] if found else None


@dataclass(frozen=True)
class TokenPlan:
    token: str  # what the home Secret holds once `action` is done; the regions' copies follow
    action: Action | None = None
    event: Event | None = None


def token_plan(job: DecoupledDiLoCoJob, obs: Observed, fresh: str) -> TokenPlan:
    """The home token Secret's next content. `fresh` is a new random token, used if needed."""
    h = home(job)
    view = obs.clusters.get(h, ClusterView())
    request = str((job.metadata.get("annotations") or {}).get(ANNOTATION_ROTATE) or "")
    if view.problem is not None:
        return TokenPlan(view.token or fresh)
    name = builders.token_secret_name(job)
    if view.token is None:  # a request made before the job had a token is already satisfied
        notes = {ANNOTATION_ROTATION: request} if request else None
        body = builders.build_token_secret(job, fresh, annotations=notes)
        return TokenPlan(fresh, Action("create", h, "Secret", name, body))
    have = lines(view.token)
    secret = view.secrets.get(name)
    notes = dict(secret.annotations) if secret is not None else {}
    notes = {k: v for k, v in notes.items() if k in (ANNOTATION_ROTATION, ANNOTATION_ROTATED_AT)}
    if request and request != notes.get(ANNOTATION_ROTATION, "") and have:
        token = f"{fresh}\n{have[0]}"
        notes.update({ANNOTATION_ROTATION: request, ANNOTATION_ROTATED_AT: iso(obs.now)})
        body = builders.build_token_secret(job, token, annotations=notes)
        event = Event(
            "Normal",
            "TokenRotating",
            "Rotating the job's token: the old one stays accepted for "
            f"{job.spec.synchronizer.token_rotation_grace_seconds:g}s",
        )
        return TokenPlan(token, Action("replace", h, "Secret", name, body), event)
    if (
        len(have) > 1
        and _grace_over(job, obs, notes)
        and _credentials_caught_up(job, obs, view.token)
    ):
        token = have[0]
        body = builders.build_token_secret(job, token, annotations=notes)
        event = Event("Normal", "TokenRotated", "The job's old token is no longer accepted")
        return TokenPlan(token, Action("replace", h, "Secret", name, body), event)
    return TokenPlan(view.token)


def _grace_over(job: DecoupledDiLoCoJob, obs: Observed, notes: dict[str, str]) -> bool:
    try:
        since = datetime.strptime(notes.get(ANNOTATION_ROTATED_AT, ""), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return True  # two lines and no record of when: finish the rotation
    grace = timedelta(seconds=job.spec.synchronizer.token_rotation_grace_seconds)
    return obs.now.replace(tzinfo=None) >= since + grace


def _credentials_caught_up(job: DecoupledDiLoCoJob, obs: Observed, token: str | None) -> bool:
    """Every group's credentials Secret holds what the key `token` (the new key with the old
    one) derives; a group whose cluster cannot be seen has not caught up."""
    keys = lines(token)
    if not evaluator_workload.caught_up(job, obs.clusters.get(home(job), ClusterView()), keys):
        return False
    for group in job.spec.learner_groups:
        view = obs.clusters.get(target_of(job, group))
        if view is None or view.problem is not None:
            return False
        have = view.secrets.get(builders.learner_tokens_secret_name(job, group.name))
        if have is None or dict(have.data) != credentials(job, group, view, keys):
            return False
    return True


# --------------------------------------------------------------------------- learner credentials


def credentials(
    job: DecoupledDiLoCoJob, group: LearnerGroup, view: ClusterView, keys: Sequence[str]
) -> dict[str, bytes]:
    """A group's credentials Secret's data: an item per learner id of its slots (and of any
    pod of the group still there, e.g. a removed slot's pod draining), and one per spare pod,
    those there and the next ones `spares.refill` may create, so the Secret holds a pod's item
    before the pod exists; a promoted spare's item holds its slot's learner credential. Each
    item holds one line per key, newest first."""
    pods = [p for p in view.pods if p.job_uid == job.uid and p.group == group.name]
    ids = {builders.learner_id(group.name, i) for i in range(group.replicas)}
    ids |= {builders.learner_id(p.group, p.index) for p in pods if not p.spare and p.index >= 0}
    spare_pods = {
        builders.spare_pod_name(job, group.name, s) for s in serials_wanted(job, group, view.pods)
    }
    # A promoted spare keeps mounting its own item; once its labels name a slot, that item
    # holds the slot's learner credential (what the learner falls back to after a 401).
    promoted = {
        p.name: builders.learner_id(p.group, p.index)
        for p in pods
        if not p.spare and p.serial is not None and p.index >= 0
    }
    data = {lid: derived_lines(keys, "learner", lid).encode() for lid in ids}
    for pod in spare_pods | set(promoted):
        lid = promoted.get(pod)
        data[builders.spare_token_key(pod)] = (
            derived_lines(keys, "learner", lid)
            if lid is not None
            else derived_lines(keys, "spare", pod)
        ).encode()
    return dict(sorted(data.items()))


def credentials_action(
    job: DecoupledDiLoCoJob, group: LearnerGroup, tgt: Target, view: ClusterView, token: str
) -> Action | None:
    """The write that makes the group's credentials Secret hold what the key `token`
    derives (None: it already does, or the name is another job's, which the runtime reports).
    reconcile.py plans it before the group's pods, which mount it."""
    name = builders.learner_tokens_secret_name(job, group.name)
    have = view.secrets.get(name)
    if have is not None and have.job_uid and have.job_uid != job.uid:
        return None
    data = credentials(job, group, view, lines(token))
    if have is not None and dict(have.data) == data:
        return None
    body = builders.build_learner_tokens_secret(
        job, group.name, data, tgt.namespace, owned=tgt.secret is None
    )
    return Action("create" if have is None else "replace", tgt, "Secret", name, body)


def secret_names(job: DecoupledDiLoCoJob, tgt: Target) -> dict[str, str]:
    """Group -> credentials Secret name, for the groups that have or had learners in `tgt`:
    the spec's and, for the cleanup, the last status' (each is read by name, never listed)."""
    groups = job.spec.learner_groups if job.spec is not None else []  # None: being deleted
    names = {g.name for g in groups if target_of(job, g) == tgt}
    names |= {g.name for g in job.status.groups if tgt in status_targets(job, g)}
    return {g: builders.learner_tokens_secret_name(job, g) for g in sorted(names)}


def prune(job: DecoupledDiLoCoJob, obs: Observed) -> list[Action]:
    """Deletes of credentials no pod needs: the credentials Secret of a group no longer in
    that target."""
    out: list[Action] = []
    for tgt, view in obs.clusters.items():
        if view.problem is not None:
            continue
        wanted = {
            builders.learner_tokens_secret_name(job, g.name)
            for g in job.spec.learner_groups
            if target_of(job, g) == tgt
        }
        for group, name in secret_names(job, tgt).items():
            have = view.secrets.get(name)
            now = target_of_group(job, group)
            if now is not None and now != tgt and place(obs, tgt) == place(obs, now) is not None:
                continue  # one namespace reached two ways: the group's own target keeps it
            if name not in wanted and have is not None and have.job_uid == job.uid:
                out.append(Action("delete", tgt, "Secret", name))
    return out
