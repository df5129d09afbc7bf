"""`ddiloco local --tensorboard DIR`: the event files of a real run, read back record by record.

pytest tests/e2e/test_tensorboard.py

The files are TFRecords (length, masked CRC-32C, an `Event` protobuf, masked CRC); they are
parsed here with tensorboardX's own protobuf classes and CRC, and the scalars must be the
report's: the eval losses, goodput and merged-work ratio over time, the final bytes.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c

    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall time)] of every event file in `folder`."""
    from tensorboardX.proto.event_pb2 import Event

    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files, f"no event files in {folder}"
    scalars: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for path in files:
        data, i = path.read_bytes(), 0
        while i < len(data):
            head = data[i : i + 8]
            (n,) = struct.unpack("<Q", head)
            assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc(head)
            body = data[i + 12 : i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked_crc(body)
            i += 16 + n
            event = Event.FromString(body)
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    scalars[v.tag].append((event.step, v.simple_value, event.wall_time))
    return scalars


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-5)  # float32 in the file


def test_event_files_hold_the_reports_scalars(reported_run) -> None:
    r = reported_run.report
    tags = read_scalars(reported_run.tensorboard)

    evals = tags["eval/loss"]
    expected = [(0, r["eval_loss_initial"]), *[(v, loss) for _, loss, v in r["eval_history"]]]
    assert [s for s, _, _ in evals] == [s for s, _ in expected]
    assert all(close(a, b) for (_, a, _), (_, b) in zip(evals, expected, strict=True))
    assert close(evals[-1][1], r["eval_loss_final"])
    # wall times: the initial loss at the run's start, each evaluation when it was measured
    t0 = evals[0][2]
    for (_, _, wall), (t, _, _) in zip(evals[1:], r["eval_history"], strict=True):
        assert abs(wall - t0 - t) < 2e-3  # the report rounds to milliseconds

    rows = r["timeseries"]
    assert len(rows) >= 5
    for key in ("goodput", "merged_work_ratio", "tokens_computed"):
        got = tags[f"run/{key}"]
        assert [s for s, _, _ in got] == [row["version"] for row in rows], key
        assert [v for _, v, _ in got] == pytest.approx([row[key] for row in rows], rel=1e-6), key
    # the last row and the report: the same interval, each rounded to 4 decimals on its own
    assert tags["run/goodput"][-1][1] == pytest.approx(r["goodput"], abs=1.5e-4)
    assert tags["run/merged_work_ratio"][-1][1] == pytest.approx(r["merged_work_ratio"], abs=1.5e-4)
    for key in ("goodput", "merged_work_ratio", "eval_loss_final"):
        ((step, value, _),) = tags[f"summary/{key}"]
        assert step == r["global_version"] and close(value, r[key]), key
    # the synchronizer's counters, sampled as the run went: rising, ending at the final status
    for key in ("bytes_up", "bytes_down", "tokens_merged"):
        values = [v for _, v, _ in tags[f"sync/{key}"]]
        assert values == sorted(values) and close(values[-1], r[key]), key
    # training loss of every learner that trained, at its own steps
    for learner in r["learners"]:
        got = tags[f"train/loss/{learner['id']}"]
        assert got and all(0 < v < 10 for _, v, _ in got), learner["id"]
