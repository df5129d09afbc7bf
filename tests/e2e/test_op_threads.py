"""`DDILOCO_TORCH_THREADS` reaches the synchronizer process's torch (synchronizer/config.py).

pytest tests/e2e/test_op_threads.py
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.local.processes import terminate_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.mark.parametrize("setting", ["3", ""])
def test_the_synchronizer_runs_its_tensor_operations_on_the_threads_set(
    tmp_path: Path, synchronizer_process: Callable[..., Any], setting: str
) -> None:
    env = {"DDILOCO_TORCH_THREADS": setting} if setting else {}
    proc = synchronizer_process(tmp_path, "tok", **env)
    try:
        proc.start()
        found = re.search(r"op_threads=(\d+)", proc.log.read_text())
    finally:
        terminate_all([proc.child])
    assert found, proc.log.read_text()[-2000:]
    expected = int(setting) if setting else max(1, (os.cpu_count() or 1) // 4)
    assert int(found.group(1)) == expected
