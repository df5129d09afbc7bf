"""The job's bearer token, and rotating it without restarting a pod (issue 12 §4).

    kubectl annotate ddj my-job ddiloco.dev/rotate-token="$(date +%s)" --overwrite

Pure, like reconcile.py: `token_plan(job, obs, fresh)` says what the home token Secret should
hold and which write gets it there. A rotation is asked for by giving the job's annotation
`ddiloco.dev/rotate-token` a value the operator has not acted on yet (any string; a date is
handy). Then:

1. The home Secret `<job>-token` becomes "new\\nold" and records the request in its own
   annotations (`ddiloco.dev/token-rotation`: the value acted on, `ddiloco.dev/token-rotated-at`:
   when). reconcile.py copies it to every region as usual. The synchronizer accepts every line
   of its token file; learners send the first one. Both re-read the mounted file when the
   kubelet updates it, so nothing restarts.
2. Once `spec.synchronizer.tokenRotationGraceSeconds` have passed and every region's copy
   holds the two lines (a region that cannot be reached keeps the old token accepted rather
   than locking its learners out), the Secret becomes "new" alone, everywhere.

The state lives in the Secret's annotations, so an operator restart mid-rotation carries on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from ddiloco.operator import builders
from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.plan import Action, ClusterView, Event, Observed, home, iso, target_of

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
    if len(have) > 1 and _grace_over(job, obs, notes) and _copies_caught_up(job, obs, view.token):
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


def _copies_caught_up(job: DecoupledDiLoCoJob, obs: Observed, token: str | None) -> bool:
    """Every remote group's copy holds the home content (the new token with the old one)."""
    for group in job.spec.learner_groups:
        tgt = target_of(job, group)
        if tgt.secret is None:
            continue
        view = obs.clusters.get(tgt)
        if view is None or view.problem is not None or view.token != token:
            return False
    return True
