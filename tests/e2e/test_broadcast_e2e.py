"""Delta downloads end to end (wire/broadcast.py, synchronizer/served_versions.py): a real synchronizer serving
`int8-delta` and two real learner processes training against it on loopback.

    .venv/bin/pytest -q tests/e2e/test_broadcast_e2e.py -m e2e

The learners merge (versions advance), download int8 deltas through the upload port (the
synchronizer's bytes-served counter has int8-delta bytes, and fewer fp32 ones than a
float32 broadcast of every version would need), and every global copy a learner adopted is
bit for bit the served copy of that version, as the test process read it whole from the
synchronizer while they trained.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.local.processes import terminate_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """The learner's digest (learner/group.py `Group.digest`) of a fragment's tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].float().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_learners_following_int8_deltas_hold_the_served_copy_bit_for_bit(
    tmp_path: Path,
    synchronizer_process: Callable[..., Any],
    learner_process: Callable[..., Any],
) -> None:
    sync = synchronizer_process(
        tmp_path, "tok", "--quorum", "2", "--upload-port", "0",
        DDILOCO_BROADCAST_ENCODING="int8-delta",
    )  # fmt: skip
    # long enough to adopt several merges when a loaded machine slows the synchronizer
    flags = ["--max-steps", "200", "-H", "4", "-P", "2", "--adoption", "overwrite"]
    flags += ["--update-encoding", "bfloat16", "--debug-digests"]
    learners = [learner_process(tmp_path, sync, i, 2, *flags) for i in range(2)]
    served: dict[tuple[int, int], str] = {}  # (fragment, version) -> the whole copy's digest
    try:
        sync.start()
        for learner in learners:
            learner.start()
        probe = sync.client()
        deadline = time.time() + 240
        while any(learner.alive() for learner in learners):
            assert time.time() < deadline, learners[0].log_path.read_text()[-3000:]
            status = probe.status()
            for f in status.fragments:
                if (f.index, f.version) not in served:
                    version, tensors = probe.fragment(f.index)  # whole: float32 of S_v
                    served[(f.index, version)] = digest(tensors)
            time.sleep(0.02)
        for learner in learners:
            assert learner.exit_code() == 0, learner.log_path.read_text()[-3000:]
        scrape = probe.request("GET", "/metrics")[2].decode()
        probe.close()
    finally:
        terminate_all([*learners, sync.child])
    by_label = {
        line.split('encoding="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in scrape.splitlines()
        if line.startswith("ddiloco_bytes_served_total{")
    }
    assert by_label.get("int8-delta", 0) > 0, by_label
    checked = 0
    for i in range(2):
        events = [json.loads(x) for x in (tmp_path / f"l{i}.jsonl").read_text().splitlines()]
        adopted = [e for e in events if e.get("event") == "adopt" and e["version"] > 0]
        assert len(adopted) >= 4, adopted
        for e in adopted:
            want = served.get((e["fragment"], e["version"]))
            if want is not None:
                assert e["global_digest"] == want, (i, e)
                checked += 1
    assert max(v for _, v in served) >= 4
    assert checked >= 4, (checked, sorted(served))
