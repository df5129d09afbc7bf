"""`ddiloco local`: one synchronizer and M learners as processes on loopback.

    run = LocalRun(LocalConfig(learners=3, max_seconds=60, chaos="kill", seed=1))
    report = run.run()          # dict, also written to <out>/report.json
    LocalConfig(tls=True)       # HTTPS (HTTP/2 by ALPN) between learners and synchronizer
    LocalConfig(mtls=True)      # ... and a client certificate for every learner (mutual TLS)
    LocalConfig(sync_shards=2)  # two synchronizer shards (synchronizer/shards.py)

It starts the synchronizer, waits for /healthz, starts the learners, applies the chaos
schedule (kills and restarts, pauses, a slow half, a synchronizer kill), measures the
global model's eval loss as it goes, stops everything at the budget, and hands the
timeline to report.py. Nothing here trains: the children do.

With `tls` the run issues its own CA (wire/tls.py) into <out>/tls: ca.crt, a server
certificate for 127.0.0.1 and localhost, and with `mtls` a client certificate per learner
slot (CN = its id) and one for the launcher's own calls; key files are 0600 and the CA's key
is never written (every certificate the run needs is issued up front).

With `sync_shards` S > 1 it runs S synchronizer processes (`synchronizer-<i>`, state in
<out>/sync-<i>, a port each); learners get the comma list of their URLs in shard order, and
the launcher's own calls (health, status, evaluation) go through `ShardClients`, so
the live table, the samples and the report are `merge_statuses` of the shards'. The chaos
`sync` event kills shard `seed % S` (or the shard a ready schedule names).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.local import scrapes
from ddiloco.local.chaos import ChaosEvent, learner_ids, make_schedule
from ddiloco.local.config import LocalConfig
from ddiloco.local.netcut import CutProxies
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.local.supervisor import Supervisor
from ddiloco.wire import tls
from ddiloco.wire.auth import learner_token
from ddiloco.wire.tls import ClientTLS

if TYPE_CHECKING:  # sync_client.py imports torch: not before a run starts (`ddiloco local` errors)
    from ddiloco.learner.sync_client import SyncClient

__all__ = ["LocalConfig", "LocalRun"]  # LocalConfig lives in local/config.py

log = logging.getLogger(__name__)


def state_dirs(root: Path, shards: int) -> list[Path]:
    """Where a run keeps each synchronizer shard's state: <root>/state (one), <root>/sync-<i>."""
    if shards == 1:
        return [root / "state"]
    return [root / f"sync-{i}" for i in range(shards)]


class LocalRun(Supervisor):
    """Owns the children and the run's clock. Failure of a child is chaos, not an error:
    a learner that exits on its own before its budget is logged and restarted."""

    def __init__(self, cfg: LocalConfig, on_tick: Callable[[LocalRun], None] | None = None) -> None:
        self.cfg = cfg
        schedule = cfg.schedule or (
            make_schedule(cfg.chaos, learners=cfg.learners, steps=cfg.max_steps, seed=cfg.seed)
            if cfg.chaos_unit == "steps"
            else make_schedule(
                cfg.chaos, learners=cfg.learners, seconds=cfg.max_seconds or 120.0, seed=cfg.seed
            )
        )
        super().__init__(cfg.out, schedule)  # out, schedule, steps_done, t0, applied, spares
        self.token = secrets.token_urlsafe(24)
        self.ports = [free_port() for _ in range(cfg.sync_shards)]
        self.port = self.ports[0]
        self.upload_ports = [free_port() for _ in range(cfg.sync_shards)]
        """Each shard's upload port (synchronizer/upload_port.py): learners post updates there."""
        self.tls_dir = self.out / "tls"
        self.client_tls = self._issue_certificates() if cfg.tls else None
        scheme = "https" if cfg.tls else "http"
        self.urls = [f"{scheme}://127.0.0.1:{port}" for port in self.ports]
        """Every shard's URL, in shard order (one: unsharded)."""
        self.url = self.urls[0]
        self.http_version = ""
        """The protocol the launcher's last status call came over (HTTP/2 expected)."""
        # A learner the schedule partitions talks to the synchronizer through a relay we can cut.
        # Its uploads go through relays of their own, cut with the others: first the S main
        # ports' relays, then the S upload ports'.
        self.proxies = {
            e.target: CutProxies(self.ports + self.upload_ports)
            for e in self.schedule.events
            if e.action == "partition"
        }
        self.reconnect_at: dict[str, float] = {}
        self.added: dict[str, float] = {}
        self.removed: dict[str, float] = {}
        """Scavenging: when an absent slot joined and when a slot left for good (time.time())."""
        self.on_tick = on_tick
        self.t_launch = 0.0
        # t0, when training began (Supervisor): the first inner step of any learner. Budgets and
        # goodput count from there; the first start-up (imports, data) is the same for every method.
        self.metrics_ports = (
            scrapes.assign_ports(learner_ids(cfg.learners)) if cfg.learner_metrics else {}
        )
        """Learner slot -> its metrics port (`learner_metrics`)."""
        self.syncs = [self._sync_child(i) for i in range(cfg.sync_shards)]
        self.sync = self.syncs[0]
        self.learners = [
            self._learner_child(i, lid) for i, lid in enumerate(learner_ids(cfg.learners))
        ]
        self.budget_reached = False
        """A learner exited 0 on hearing the job's token budget was merged (`total_tokens`)."""
        self.evaluator: Any = None
        self.status: Any = None
        self.sampler: Any = None
        """local/samples.py: the synchronizer's status every second, fed to the sinks."""

    def _issue_certificates(self) -> ClientTLS:
        """The run's CA, the synchronizer's certificate and (mtls) every client's; returns
        the launcher's own client files."""
        d = self.tls_dir
        ca = tls.issue_ca(f"ddiloco local {self.out.name}", days=7)
        tls.write_pem(ca.cert_pem, d / "ca.crt")
        tls.write_pair(
            tls.issue_server(ca, ["localhost"], ["127.0.0.1"], days=7),
            d / "server.crt",
            d / "server.key",
        )
        if not self.cfg.mtls:
            return ClientTLS(ca_file=d / "ca.crt")
        for lid in [*learner_ids(self.cfg.learners), "launcher"]:
            tls.write_pair(tls.issue_client(ca, lid, days=7), d / f"{lid}.crt", d / f"{lid}.key")
        return ClientTLS(d / "ca.crt", d / "launcher.crt", d / "launcher.key")

    def client(self, timeout: float = 60.0) -> SyncClient:
        """A SyncClient for the launcher's own calls (health, status), TLS files included;
        with shards, a `ShardClients` (the same calls, the status merged)."""
        from ddiloco.learner.shard_clients import ShardClients
        from ddiloco.learner.sync_client import SyncClient

        if len(self.urls) > 1:
            clients = ShardClients(self.urls, self.token, timeout=timeout, tls=self.client_tls)
            return clients  # type: ignore[return-value]
        return SyncClient(self.url, self.token, timeout=timeout, tls=self.client_tls)

    def _sync_child(self, shard: int = 0) -> Child:
        c = self.cfg
        state = state_dirs(self.out, c.sync_shards)[shard]
        argv = ddiloco_command(
            "synchronizer",
            "--port",
            str(self.ports[shard]),
            "--upload-port",
            str(self.upload_ports[shard]),
            "--state-dir",
            str(state),
            "--quorum",
            str(c.quorum),
            "--merge",
            c.merge,
            "--log-level",
            "WARNING",
        )
        if not c.grace:
            argv.append("--no-grace")
        if c.sync_shards > 1:
            argv += ["--shard", str(shard), "--shards", str(c.sync_shards)]
        if c.total_tokens:
            argv += ["--total-tokens", str(c.total_tokens)]
        if c.tls:
            argv += ["--tls-cert", str(self.tls_dir / "server.crt")]
            argv += ["--tls-key", str(self.tls_dir / "server.key")]
        if c.mtls:
            argv += ["--tls-client-ca", str(self.tls_dir / "ca.crt")]
        env = env_with(
            DDILOCO_TOKEN=self.token,
            DDILOCO_TAU=str(c.tau),
            DDILOCO_OUTER_LR=str(c.outer_lr),
            DDILOCO_OUTER_MOMENTUM=str(c.outer_momentum),
            DDILOCO_COUNTER_CAP_STEPS=str(4 * c.h),
            DDILOCO_UPDATE_ENCODINGS=c.update_encoding,
            DDILOCO_BROADCAST_ENCODING=c.broadcast_encoding,
            DDILOCO_MERGE_SCALE=c.merge_scale,
        )
        name = "synchronizer" if c.sync_shards == 1 else f"synchronizer-{shard}"
        return Child(name, argv, env, self.out / "logs" / f"{name}.log")

    def _learner_child(self, index: int, lid: str) -> Child:
        c = self.cfg
        sync_url, relayed = ",".join(self.urls), []
        if lid in self.proxies:
            relays = [p.url for p in self.proxies[lid].proxies]
            sync_url = ",".join(relays[: c.sync_shards])
            relayed = ["--upload-url", ",".join(relays[c.sync_shards :])]
        argv = ddiloco_command(
            "learner",
            "--sync-url",
            sync_url,
            "--learner-id",
            lid,
            "--learner-index",
            str(index),
            "--num-learners",
            str(c.learners),
            "--batch-size",
            str(c.batch_size),
            "--seed",
            str(c.seed),
            "--inner-lr",
            str(c.inner_lr),
            "-H",
            str(c.h),
            "-P",
            str(c.fragments),
            "--log-path",
            str(self.learner_log(lid)),
            "--log-every",
            "0",
            "--threads",
            "1",
            "--slow-factor",
            str(self.schedule.slow_factors.get(lid, 1.0)),
            "--update-encoding",
            c.update_encoding,
            "--log-level",
            "WARNING",
            *relayed,
        )
        if c.model_entry:
            argv += ["--model-entry", c.model_entry]
        else:
            argv += ["--model", c.model]
        if c.data:
            argv += ["--data", c.data, "--data-field", c.data_field]
        if c.tokenizer:
            argv += ["--tokenizer", c.tokenizer]
        if c.init_from:
            argv += ["--init-from", c.init_from]
        if c.nproc_per_node > 1:
            argv += ["--nproc-per-node", str(c.nproc_per_node)]
        if c.tls:  # flags, not env: a hot spare takes the slot's argv (local/spare.py)
            argv += ["--ca-file", str(self.tls_dir / "ca.crt")]
        if c.mtls:
            argv += ["--client-cert", str(self.tls_dir / f"{lid}.crt")]
            argv += ["--client-key", str(self.tls_dir / f"{lid}.key")]
        if lid in self.metrics_ports:
            argv += ["--metrics-port", str(self.metrics_ports[lid])]
        # the slot's own credential: it speaks for `lid` alone (the key stays with the
        # synchronizer and the launcher)
        env = env_with(DDILOCO_TOKEN=learner_token(self.token, lid), OMP_NUM_THREADS="1")
        if self.metrics_ports:
            env["DDILOCO_METRICS_HOST"] = "127.0.0.1"
        return Child(lid, argv, env, self.out / "logs" / f"{lid}.log")

    def _start_learner(self, child: Child) -> None:
        """Start a slot with the steps it has left; a restart may take a hot spare."""
        argv = list(child.argv)
        if self.cfg.max_steps:
            left = max(1, self.cfg.max_steps - self.steps_done(child.name))
            argv += ["--max-steps", str(left)]
        self.start_child(child, argv, spare=bool(child.starts))

    def _wait_healthy(self, timeout: float = 60.0) -> None:
        client = self.client(timeout=5.0)
        deadline = time.time() + timeout
        while not client.healthy():
            for sync in self.syncs:
                if not sync.alive():
                    raise RuntimeError(f"synchronizer exited; see {sync.log_path}")
            if time.time() > deadline:
                raise RuntimeError(
                    f"synchronizer not healthy after {timeout:.0f}s; see {self.out / 'logs'}"
                )
            time.sleep(0.05)
        client.close()

    def _by_name(self) -> dict[str, Child]:
        """Chaos targets: every child by name; "synchronizer" is shard seed % S."""
        by_name = {c.name: c for c in [*self.syncs, *self.learners]}
        by_name.setdefault("synchronizer", self.syncs[self.cfg.seed % len(self.syncs)])
        return by_name

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        """Signal a process, cut its relay, start or stop a scavenged slot; the record adds
        `hot_spare` (a killed learner handed to a hot spare at once)."""
        child = self._by_name()[ev.target]
        hot = False  # handed to a hot spare at once (spare_takeover immediate)
        if ev.action == "add":
            if child.proc is not None:
                return None
            self._start_learner(child)
            self.added[child.name] = time.time()
        elif child.finished or not child.alive():
            return None
        elif ev.action == "remove":
            child.stop()
            child.finished = True
            self.removed[child.name] = time.time()
        elif ev.action == "partition":
            self.proxies[child.name].cut()
            self.reconnect_at[child.name] = now + ev.delay
        elif ev.action in ("kill", "kill_sync"):
            child.kill()
            child.restart_at = now + ev.delay
            if (
                ev.action == "kill"
                and self.cfg.spare_takeover == "immediate"
                and self.spares is not None
                and self.spares.ready()
            ):
                child.restart_at, hot = now, True  # a hot spare takes the slot over
        elif ev.action == "pause":
            child.pause()
            child.resume_at = now + ev.delay
        log.info(
            "Chaos %s %s (back in %.1fs%s)",
            ev.action,
            ev.target,
            0.0 if hot else ev.delay,
            ", a hot spare takes over" if hot else "",
        )
        return {"hot_spare": hot}

    def recover(self, now: float) -> None:
        """Reconnect the cut off, resume the paused, restart the killed that are due."""
        for lid, at in list(self.reconnect_at.items()):
            if now >= at:
                self.proxies[lid].restore()
                del self.reconnect_at[lid]
        for child in self._by_name().values():
            if child.resume_at is not None and now >= child.resume_at:
                child.resume()
            if child.restart_at is not None and now >= child.restart_at:
                if child in self.syncs:
                    child.start()
                else:
                    self._start_learner(child)

    def _check_started(self) -> None:
        """Before the first step: a learner that exited is an error (its log's tail)."""
        for child in self.learners:
            if child.exit_code() is not None:
                tail = child.log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(
                    f"{child.name} exited before its first step:\n" + "\n".join(tail)
                )

    def _check_learners(self, now: float) -> None:
        for child in self.learners:
            if child.proc is None or child.finished or child.restart_at is not None:
                continue  # not added yet (scavenging), done, or waiting for its replacement
            if child.alive():
                continue
            code = child.exit_code()
            if (
                code == 0
                and self.cfg.max_steps
                and self.steps_done(child.name) >= self.cfg.max_steps
            ):
                child.finished = True
            elif code == 0 and self.cfg.total_tokens and self._stop_reason(child) == "finished":
                child.finished = self.budget_reached = True
                log.info("Learner %s stopped: the job's token budget is merged", child.name)
            else:
                log.warning("Learner %s exited with %s; restarting it", child.name, code)
                child.restart_at = now + 1.0

    def _stop_reason(self, child: Child) -> str:
        """The stop reason in the last "stop" record of the slot's step log ("" if none)."""
        from ddiloco.local.report import read_jsonl

        stops = [r for r in read_jsonl(self.learner_log(child.name)) if r.get("event") == "stop"]
        return str(stops[-1].get("stop_reason", "")) if stops else ""

    def done(self, now: float) -> bool:
        if self.cfg.max_seconds and now >= self.cfg.max_seconds:
            return True
        if self.budget_reached:  # the job is done: a slot waiting for its restart needs none
            for c in self.learners:
                if not c.finished and c.restart_at is not None and not c.alive():
                    c.finished, c.restart_at = True, None
            return all(c.finished or c.proc is None for c in self.learners)
        return all(c.finished for c in self.learners)

    def run(self) -> dict[str, Any]:
        from ddiloco.learner.evaluator import GlobalEvaluator
        from ddiloco.local.report import build_report

        (self.out / "schedule.json").write_text(self.schedule.to_json())
        children = [*self.syncs, *self.learners]
        try:
            for sync in self.syncs:
                sync.start()
            self._wait_healthy()
            if self.metrics_ports:
                scrapes.write_index(self.out, self.url, self.metrics_ports, self.urls)
            for proxy in self.proxies.values():
                proxy.start()
            if self.cfg.hot_spares:
                from ddiloco.local.spare import SparePool

                pool_env = dict(self.learners[0].env)
                pool_env.pop("DDILOCO_TOKEN")  # a spare is handed its slot's with the slot
                self.spares = SparePool(
                    "ddiloco.learner.train",
                    pool_env,
                    self.out / "logs" / "spares",
                    size=self.cfg.hot_spares,
                )
                self.spares.fill()
            self.t_launch = time.time()
            for child in self.learners:
                if child.name not in self.schedule.absent:
                    self._start_learner(child)
            c = self.cfg
            self.evaluator = GlobalEvaluator(
                ",".join(self.urls),
                self.token,
                tls=self.client_tls,
                preset=c.model,
                data=c.data,
                model_entry=c.model_entry,
                seed=c.seed,
                batch_size=c.batch_size,
                every_s=c.eval_every,
                tokenizer=c.tokenizer,
                data_field=c.data_field,
                init_from=c.init_from,
                post=True,  # the synchronizer's /v1/status and ddiloco_eval_* show it too
            )
            self.evaluator.start()
            self.wait_first_step(
                self.learners,
                self.t_launch,
                f"no learner took a step within 300 s; see {self.out / 'logs'}",
                self._check_started,
            )
            self.sampler = self._sampler()
            self.sampler.start()
            while True:
                now = self.elapsed()
                if self.done(now):
                    break
                self.apply_chaos(now)
                self._check_learners(now)
                if self.on_tick:
                    self.on_tick(self)
                time.sleep(0.05)
            self.t_end = time.time()
            for lid, port in self.metrics_ports.items():  # their last scrapes, still training
                scrapes.save(self.out, lid, scrapes.scrape(scrapes.learner_url(port)))
            terminate_all(self.learners)
            self.evaluator.stop()
            self.sampler.stop()
            for sync in self.syncs:  # a synchronizer killed near the end: bring it back
                if not sync.alive():
                    sync.start()
            self._wait_healthy()  # a restarted one may still be starting (imports, state)
            time.sleep(0.3)  # last merges of updates the learners flushed on SIGTERM
            self.evaluator.evaluate()
            client = self.client()
            self.status = client.status()
            self.http_version = client.http_version
            if self.metrics_ports:  # after the learners' last updates merged
                body = client.request("GET", "/metrics")[2]
                scrapes.save(self.out, "synchronizer", body.decode())
            self.sampler.sample_once(self.status, at=self.t_end)
            client.close()
        finally:
            if self.sampler is not None:
                self.sampler.stop()
            terminate_all(children)
            for proxy in self.proxies.values():
                proxy.close()
            if self.spares is not None:
                self.spares.close()
        report = build_report(self)
        if self.metrics_ports:
            report["metrics"] = json.loads((self.out / scrapes.INDEX).read_text())
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        if self.sampler is not None:
            self.sampler.finish(report)
        return report

    def _sampler(self) -> Any:
        from ddiloco.local.samples import StatusSampler

        sinks = []
        if self.cfg.tensorboard is not None:
            from ddiloco.local.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(Path(self.cfg.tensorboard) / self.out.name))
        return StatusSampler(
            self.client(timeout=5.0), t0=self.t0, evaluator=self.evaluator, sinks=sinks
        )
