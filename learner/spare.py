"""`ddiloco learner` as a hot spare: warm up first, then wait to be handed a slot.

    DDILOCO_SPARE=1 DDILOCO_POD_NAME=job-a-spare-0-abcde DDILOCO_TOKEN=t \
        ddiloco learner --sync-url http://127.0.0.1:8470 --model tiny

The operator starts such pods per learner group (`failurePolicy.hotSpares`, operator/spares.py)
with everything a slot's pod has except the slot's identity (DDILOCO_LEARNER_ID,
DDILOCO_LEARNER_INDEX, DDILOCO_NUM_LEARNERS). `wait_for_slot` here:

1. does a cold start's work: imports torch and the training code, builds the model and reads
   the corpus as the settings say (on a throwaway shard), and takes one throwaway AdamW step
   (the first optimizer step imports torch._dynamo and sympy, the first backward starts
   autograd's threads);
2. writes the ready file (`builders.SPARE_READY_FILE`; the pod's readiness probe waits for it);
3. long-polls `GET /v1/spares/<pod>` (with its own spare credential, which reads nothing but
   this pod's assignment; TLS files as the learner's own) until the synchronizer has an
   assignment for it, the one the operator PUTs when it promotes this pod (and PUTs again
   should a restarted synchronizer have lost it);
4. sets the slot's identity, and the slot's learner credential that came with it, in the
   environment and returns: `ddiloco learner` then runs as a slot's learner would (join,
   fetch, train), in this process, its imports warm, speaking for that slot alone.

The variables DDILOCO_SPARE and DDILOCO_POD_NAME are taken out of the environment first, so
the learner proper never sees them (LearnerConfig reads neither).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

SPARE_ENV: Final = "DDILOCO_SPARE"
POD_ENV: Final = "DDILOCO_POD_NAME"
READY_FILE: Final = "/tmp/ddiloco-spare-ready"  # = operator.builders.SPARE_READY_FILE
WAIT_S: Final = 20.0  # one long poll; the synchronizer answers 204 after it
IDENTITY: Final = {
    "learner_id": "DDILOCO_LEARNER_ID",
    "learner_index": "DDILOCO_LEARNER_INDEX",
    "num_learners": "DDILOCO_NUM_LEARNERS",
}


def enabled(environ: MutableMapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(SPARE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def warm(cfg: Any) -> float:
    """The cold-start work (see the module docstring); returns the seconds it took."""
    t0 = time.monotonic()
    import torch

    from ddiloco.learner import train  # torch, the model, the streaming client
    from ddiloco.learner.task import build_task

    device = train.pick_device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    task = build_task(
        preset=cfg.model,
        data=cfg.data,
        model_entry=cfg.model_entry,
        learner_index=0,
        num_learners=1,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        device=str(device),
        tokenizer=cfg.tokenizer,
        data_field=cfg.data_field,
        # the slot (so its shard) is not known yet: warm the model, the tokenizer and the eval
        # set every slot shares, not one shard (a whole corpus to tokenize for shard 0 of 1)
        eval_only=True,
    )
    opt = torch.optim.AdamW(task.model.parameters(), lr=cfg.inner_lr)
    x, y = next(task.batches)
    task.loss_fn(task.model, x, y).backward()
    opt.step()
    del task, opt
    return time.monotonic() - t0


def poll(cfg: Any, pod: str, *, wait_s: float = WAIT_S) -> dict[str, Any]:
    """Long-poll the synchronizer for this pod's assignment until one arrives (the slot's
    identity and its learner credential, `SpareGrant`); an unreachable synchronizer is
    retried with a capped backoff."""
    from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
    from ddiloco.wire.protocol import API_PREFIX, SpareGrant

    client = SyncClient(
        # a sharded synchronizer: shard 0 keeps the spares' book (the first URL)
        cfg.sync_url.split(",")[0],
        cfg.token_source(),
        timeout=wait_s + 10.0,
        tls=cfg.client_tls(),
    )
    backoff = 0.0
    try:
        while True:
            try:
                status, _, body = client.request(
                    "GET", f"{API_PREFIX}/spares/{pod}?wait_s={wait_s:g}"
                )
            except SyncUnavailable as e:
                backoff = min(5.0, max(0.2, backoff * 2))
                log.info("Spare %s: synchronizer unavailable (%s); again in %.1fs", pod, e, backoff)
                time.sleep(backoff)
                continue
            except SyncRefused as e:
                if e.status in (401, 403):  # a token being rotated: re-read, try again
                    time.sleep(1.0)
                    continue
                raise
            backoff = 0.0
            if status == 200:
                return SpareGrant.model_validate_json(body).model_dump()
    finally:
        client.close()


def wait_for_slot(args: Any, environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """Warm up, wait for a slot, put its identity into `environ` (default os.environ);
    returns the assignment. `args` are `ddiloco learner`'s parsed flags."""
    from ddiloco.learner.cli import build_config

    env = os.environ if environ is None else environ
    env.pop(SPARE_ENV, None)
    pod = env.pop(POD_ENV, "") or os.uname().nodename  # a pod's hostname is its name
    cfg = build_config(args, env)
    seconds = warm(cfg)
    ready = Path(env.pop("DDILOCO_SPARE_READY_FILE", READY_FILE))
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.write_text(f"{time.time():.3f}\n")
    log.info("Spare %s warm after %.1fs; waiting for a slot at %s", pod, seconds, cfg.sync_url)
    t0 = time.monotonic()
    found = poll(cfg, pod)
    for key, var in IDENTITY.items():
        env[var] = str(found[key])
    # the slot's credential from now on; should it be refused (a key rotation ended since),
    # the pod's own file, which the operator rewrites to the slot's credential on promotion
    env["DDILOCO_TOKEN"] = found["token"]
    log.info(
        "Spare %s takes over slot %s (data part %s of %s) after %.1fs standing by",
        pod,
        found["learner_id"],
        found["learner_index"],
        found["num_learners"],
        time.monotonic() - t0,
    )
    return found
