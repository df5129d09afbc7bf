"""A sharded synchronizer end to end: `ddiloco local --sync-shards 2`, real processes.

    pytest tests/e2e/test_shards.py -m e2e

Shows: two shards train one job (every fragment advances on its owner, the report and the
merged status show both shards' fragments); a shard SIGKILLed mid-run does not stop the
other (its fragments keep merging while the killed one is down), and the killed one restarts
on its state dir at its versions (not 0) and merges again; a raw update sent to the shard
that does not own its fragment is refused with 421, naming the owner.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.local.chaos import ChaosEvent, Schedule
from ddiloco.local.launcher import LocalConfig, LocalRun
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire import codec
from ddiloco.wire.protocol import UpdateMeta, shard_map

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def test_local_with_two_shards_trains_every_fragment(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "ddiloco.cli.main",
        "local",
        "--sync-shards",
        "2",
        "--learners",
        "2",
        "--max-seconds",
        "12",
        "--hot-spares",
        "0",
        "--quiet",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    frags = report["fragments"]
    assert [f["index"] for f in frags] == [0, 1, 2, 3]
    assert {f["shard"] for f in frags} == {0, 1}  # both shards' fragments, in one report
    assert all(f["version"] > 0 for f in frags), frags
    assert report["global_version"] == sum(f["version"] for f in frags)
    assert report["sync_shards"] == 2
    assert math.isfinite(report["eval_loss_final"])
    assert report["eval_loss_final"] < report["eval_loss_initial"]
    layout = StateStore(out / "sync-0").load_layout()
    assert layout is not None
    owners = shard_map(layout, 2)
    for i in (0, 1):  # each shard's state dir holds its own fragments, and only those
        files = sorted(p.name for p in (out / f"sync-{i}").glob("fragment-*.safetensors"))
        assert files == [f"fragment-{p:04d}.safetensors" for p, s in enumerate(owners) if s == i]


class Watch:
    """on_tick: each shard's own status every 0.3 s, whether it is up, and one misdirected
    update once training runs. Until shard 1 is seen merging again after `kill_at` (a
    restart imports torch again: many seconds on a loaded machine) the run's budget is
    stretched, up to `cap_s`, so that the test waits for what it checks and no longer."""

    def __init__(self, kill_at: float, cap_s: float) -> None:
        self.samples: list[tuple[float, int, bool, dict[int, int] | None]] = []
        self.clients: list[SyncClient] = []
        self.at = 0.0
        self.misdirected: SyncRefused | None = None
        self.kill_at, self.cap_s = kill_at, cap_s
        self.back: int | None = None
        """Shard 1's version sum when it first answered after the kill."""
        self.merged_again = False

    def __call__(self, run: LocalRun) -> None:
        if not self.clients:
            self.clients = [SyncClient(u, run.token, timeout=2.0) for u in run.urls]
        now = time.monotonic()
        if now - self.at < 0.3:
            return
        self.at = now
        for i, (sync, client) in enumerate(zip(run.syncs, self.clients, strict=True)):
            try:
                st = client.status()
                versions: dict[int, int] | None = {f.index: f.version for f in st.fragments}
            except (SyncUnavailable, SyncRefused):
                versions = None
            self.samples.append((run.elapsed(), i, sync.alive(), versions))
            if i == 1 and versions is not None and run.elapsed() > self.kill_at + 0.5:
                if self.back is None and len(run.syncs[1].starts) > 1:
                    self.back = _sum(versions)
                elif self.back is not None and _sum(versions) > self.back:
                    self.merged_again = True
        if not self.merged_again:  # wait for the restarted shard, within the cap
            run.cfg.max_seconds = min(self.cap_s, max(run.cfg.max_seconds, run.elapsed() + 3))
        if self.misdirected is None and run.elapsed() > 1.0:
            self.misdirect(run)

    def misdirect(self, run: LocalRun) -> None:
        layout_file = run.out / "sync-0" / "layout.json"
        if not layout_file.exists():
            return
        layout = StateStore(run.out / "sync-0").load_layout()
        assert layout is not None
        p = shard_map(layout, 2).index(1)  # a fragment of shard 1's, sent to shard 0
        spec = layout.fragments[p]
        meta = UpdateMeta(
            learner_id="learner-0", fragment=p, base_version=0, steps=1, tokens=1, learner_step=1
        )
        delta = {t.name: torch.zeros(t.shape) for t in spec.tensors}
        try:
            self.clients[0].post_update(p, codec.encode(delta, meta.to_metadata()))
        except SyncRefused as e:
            self.misdirected = e

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _sum(v: dict[int, int] | None) -> int:
    return sum(v.values()) if v else 0


@pytest.mark.timeout(400)
def test_a_killed_shard_resumes_at_its_versions_while_the_other_keeps_merging(
    tmp_path: Path,
) -> None:
    kill_at, down_s = 5.0, 3.0
    schedule = Schedule(
        kind="sync", seed=0, events=[ChaosEvent(kill_at, "kill_sync", "synchronizer-1", down_s)]
    )
    cfg = LocalConfig(
        learners=2,
        sync_shards=2,
        max_seconds=16.0,  # stretched by Watch until the killed shard merges again
        hot_spares=0,
        schedule=schedule,
        out=tmp_path / "run",
        eval_every=30.0,
    )
    watch = Watch(kill_at, cap_s=120.0)
    try:
        report: dict[str, Any] = LocalRun(cfg, on_tick=watch).run()
    finally:
        watch.close()
    assert watch.misdirected is not None
    assert (watch.misdirected.status, watch.misdirected.kind) == (421, "wrong_shard")
    assert "owned by shard 1" in watch.misdirected.detail
    assert report["sync_restarts"] == 1
    s0 = [(t, v) for t, i, _, v in watch.samples if i == 0 and v is not None]
    s1 = [(t, up, v) for t, i, up, v in watch.samples if i == 1]
    before = [v for t, up, v in s1 if v is not None and t < kill_at]
    down = [t for t, up, v in s1 if v is None and t >= kill_at]
    after = [v for t, up, v in s1 if v is not None and t >= kill_at]
    assert before and down and after, [(round(t, 1), up, v) for t, up, v in s1]
    # the other shard kept merging while shard 1 was down
    while_down = [v for t, v in s0 if down[0] <= t <= down[-1]]
    assert len(while_down) >= 2 and _sum(while_down[-1]) > _sum(while_down[0]), while_down
    # the killed shard came back at (at least) the versions it had served, not at 0
    last_before, first_after = before[-1], after[0]
    assert _sum(last_before) > 0
    assert first_after is not None and last_before is not None
    assert all(first_after[p] >= v for p, v in last_before.items()), (last_before, first_after)
    # and merges again
    assert _sum(after[-1]) > _sum(first_after), (first_after, after[-1])
    final = {f["index"]: f["version"] for f in report["fragments"]}
    assert all(final[p] >= v for p, v in after[-1].items())
