"""Change the world as a plan says: post its events, send its actions (apply.py does the
client calls), say what an apiserver refused, promote hot spares and deliver their
assignments to the synchronizer.

    actor = Actor(settings, clusters, StatusReader(settings), certs.StatusTLS(), timeout)
    refused = actor.act(job, obs, plan, logger, post)       # action -> (reason, message)
    actor.assign(job, obs, plan.assignments, logger, every=True)

A failed action never raises out of a pass for a remote cluster: it is logged (a repeated
failure once a minute), an apiserver's refusal comes back as a Degraded reason and message
for the next status and as a Warning event, and the next tick tries again. Failures of the
home apiserver other than not answering propagate to kopf, which retries after its backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import api as ddapi
from ddiloco.operator import certs, spares, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.apply import Timeout, foreign, send
from ddiloco.operator.clusters import (
    UNREACHABLE_ERRORS,
    ClusterProblem,
    Clusters,
    api_message,
    api_reason,
)
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.plan import Action, Assignment, ClusterView, Event, Observed, Plan, home
from ddiloco.operator.syncstatus import StatusReader

WARN_EVERY_S = 60.0  # a failure that repeats every tick is logged at most this often
PostEvent = Callable[[Event], None]


class Actor:
    """Sends plans' actions through the operator's cached cluster clients (clusters.py).

    Keeps, per job, which promoted spares' assignments the synchronizer has (spares.py) and
    when to send the others again, and when each repeated failure was last logged."""

    def __init__(
        self,
        settings: OperatorSettings,
        clusters: Clusters,
        status: StatusReader,
        status_tls: certs.StatusTLS,
        timeout: Timeout,
    ) -> None:
        self.settings = settings
        self.clusters = clusters
        self.status = status
        self.status_tls = status_tls
        self.timeout = timeout
        self._warned: dict[str, float] = {}
        self._delivered: dict[str, set[str]] = {}  # job uid -> promoted spares' pod uids
        self._resends: dict[str, spares.Resends] = {}  # job uid -> when to send again

    def act(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        obs: Observed,
        plan: Plan,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> dict[str, tuple[str, str]]:
        """Post the plan's events, then send its actions in order: a spare's promotion
        (a label patch) and then its assignment, anything else through `apply`. Returns what
        the apiservers refused, by action, for the job's next status."""
        for event in plan.events:
            post(event)
        refused: dict[str, tuple[str, str]] = {}
        for action in plan.actions:
            if action.verb == "patch" and action.kind == "Pod":  # a spare's promotion
                if self.patch(job, action, logger):
                    if action.then is not None:
                        self.assign(job, obs, [action.then], logger)
                    if action.event is not None:
                        post(action.event)
                continue
            if (refusal := self.apply(job, action, logger, post)) is not None:
                refused[action.describe()] = refusal
        return refused

    def apply(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        action: Action,
        logger: logging.Logger | logging.LoggerAdapter,
        post: PostEvent,
    ) -> tuple[str, str] | None:
        """Send one action; log and carry on when it fails (the next tick tries again).
        Returns what the apiserver refused, for the status: (Degraded reason, message); an
        event says it too, as a ReplicaSet's FailedCreate does."""
        refusal: tuple[str, str] | None = None
        client: ApiClient | None = None
        try:
            client = self.clusters.client(action.target, job.namespace)
            send(client, action, self.timeout)
            logger.debug("Done: %s", action.describe())
            if action.event is not None:
                post(action.event)
            return None
        except ClusterProblem as p:
            why = p.message
        except ApiException as e:
            why = api_reason(e)
            if e.status == 404 and action.verb == "delete":
                logger.debug("Already done: %s (%s)", action.describe(), why)
                return None
            if e.status == 409 and action.verb == "create" and client is not None:
                try:
                    conflict = foreign(client, job, action, self.timeout)
                except Exception as read_error:
                    conflict, why = None, api_reason(read_error)
                if conflict is None:
                    logger.debug("Already done: %s (%s)", action.describe(), why)
                    return None
                refusal, why = (c.NAME_CONFLICT, conflict), conflict
            elif e.status and 400 <= e.status < 500 and e.status not in (409, 429):
                if action.verb != "delete":
                    what = "create" if action.verb == "create" else "update"
                    refusal = (
                        c.FAILED_CREATE,
                        f"Could not {what} {action.kind} {action.target.namespace}/"
                        f"{action.name} in {action.target.label}: {api_message(e)}",
                    )
                    why = refusal[1]
            elif not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
        except Exception as e:
            if action.target.is_home and not isinstance(e, UNREACHABLE_ERRORS):
                raise
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
            why = api_reason(e)
        # The same failure repeats every tick (e.g. a missing namespace in a region): say it
        # once a minute, not twice a second; a refusal also as an event on the job.
        key = f"{job.namespace}|{action.describe()}|{why}"
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= WARN_EVERY_S:
            self._warned[key] = now
            logger.warning("Could not %s: %s", action.describe(), why)
            if refusal is not None:
                post(Event("Warning", refusal[0], refusal[1]))
        else:
            logger.debug("Could not %s: %s", action.describe(), why)
        return refusal

    def patch(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        action: Action,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> bool:
        """Promote a hot spare (its label patch, preconditions included); False when it was
        refused (the spare went, or was promoted meanwhile): the next pass decides again."""
        try:
            client = self.clusters.client(action.target, job.namespace)
            send(client, action, self.timeout)
        except ClusterProblem as p:
            logger.warning("Could not %s: %s", action.describe(), p.message)
            return False
        except ApiException as e:
            logger.info("Did not %s: %s", action.describe(), api_reason(e))
            if e.status in (404, 409, 422):  # gone, or a precondition failed
                return False
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
                return False
            raise
        except Exception as e:
            if action.target.is_home and not isinstance(e, UNREACHABLE_ERRORS):
                raise
            if not action.target.is_home:
                self.clusters.failed(action.target, job.namespace, e)
            logger.warning("Could not %s: %s", action.describe(), api_reason(e))
            return False
        logger.info("Done: %s", action.describe())
        return True

    def assign(
        self,
        job: ddapi.DecoupledDiLoCoJob,
        obs: Observed,
        items: list[Assignment],
        logger: logging.Logger | logging.LoggerAdapter,
        every: bool = False,
    ) -> None:
        """PUT promoted spares' assignments to the synchronizer, each until it says the spare
        fetched it (spares.py), when `spares.Resends` says it is due; a failure is logged and
        a later pass sends it again. `every`: `items` are all the pass's promoted pods that
        are alive (the others' backoff is forgotten)."""
        delivered = self._delivered.setdefault(job.uid, set())
        resends = self._resends.setdefault(job.uid, spares.Resends())
        if every:
            resends.keep({a.uid for a in items})
        clock = time.monotonic()
        todo = [a for a in items if a.uid not in delivered and resends.due(a, clock)]
        if not todo:
            return
        view = obs.clusters.get(home(job), ClusterView())
        token = tokens.current(view.token)
        if token is None:
            return
        url = self.status.url(job)
        context = self.status_tls.context(job, view, obs.now)
        for item in todo:
            try:
                done = spares.put_assignment(
                    url, token, context, item, self.settings.http_timeout_seconds
                )
            except (OSError, ValueError) as e:
                resends.sent(item, clock, delivered=False)
                logger.info(
                    "Could not send the assignment of spare %s to the synchronizer: %s",
                    item.pod,
                    type(e).__name__,
                )
                continue
            resends.sent(item, clock, delivered=done)
            logger.debug("Sent the assignment of spare %s (delivered: %s)", item.pod, done)
            if done:
                if len(delivered) > 100_000:
                    delivered.clear()
                delivered.add(item.uid)

    def forget(self, uid: str) -> None:
        """A deleted job's bookkeeping goes with it."""
        self._delivered.pop(uid, None)
        self._resends.pop(uid, None)
