"""The project's image on the real node of a plane: the tests that run jobs in real pods share it.

    tag = realnode_image.on_node(real_plane, tmp_path_factory)   # localhost/ddiloco:<key>

The image for the current tree (image.py: built if missing, which takes minutes cold) is saved
as an archive and imported into the node's containerd, unless the node already holds it; a
node keeps what was imported for as long as it runs, so the second module of a session pays
nothing. Pods then name the tag with imagePullPolicy Never.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if "image" not in sys.modules:  # image.py sits beside k8senv.py; loaded by path like it
    _spec = importlib.util.spec_from_file_location("image", Path(__file__).with_name("image.py"))
    assert _spec is not None and _spec.loader is not None
    sys.modules["image"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["image"])
import image


def on_node(plane: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image's tag, present in `plane`'s real node (imported now if it was not)."""
    tag = str(image.ensure_image())
    if not any(name.endswith(tag) for name in plane.real_node.images()):
        archive = tmp_path_factory.mktemp("image") / "ddiloco.tar"
        image.save_archive(tag, archive)
        t0 = time.monotonic()
        plane.import_image(archive)
        print(f"\nimage {tag}: imported into the node in {time.monotonic() - t0:.1f}s")
        archive.unlink()
    return tag
