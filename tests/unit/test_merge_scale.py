"""`merge_scale = live`: a merge's progress is averaged over the whole
live set's tokens per period, not only over the contributors present in it, so that K = 1
moves Theta like averaging instead of by the sum of the learners' deltas.

A real Synchronizer on a real state directory; a fake clock only for liveness.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.merge import Contribution, MergePolicy
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[2])])])
A, B = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def sync_for(state: Path, clock: Clock, scale: str, quorum: int = 1) -> Synchronizer:
    settings = SyncSettings(
        token="t",
        state_dir=state,
        quorum=quorum,
        grace=False,
        outer_lr=1.0,
        outer_momentum=0.0,
        max_update_ratio=10.0,
        max_staleness=4,
        merge_scale=scale,  # type: ignore[arg-type]
        broadcast_encoding="float32",  # the served copy is Theta exactly: the merge's figures
    )
    return Synchronizer(settings, clock=clock)


def beat(sync: Synchronizer, lid: str) -> None:
    sync.heartbeat(
        Heartbeat(learner_id=lid, step=1, steps=[1], tokens=[1], base_versions=[0], step_seconds=1)
    )


def update(lid: str, value: torch.Tensor, *, base: int, tokens: int = 100, step: int = 10) -> bytes:
    meta = UpdateMeta(
        learner_id=lid,
        fragment=0,
        base_version=base,
        steps=10,
        tokens=tokens,
        learner_step=step,
        incarnation=1,
    )
    return codec.encode({"w": value}, meta.to_metadata())


def started(state: Path, clock: Clock, scale: str, quorum: int = 1) -> Synchronizer:
    sync = sync_for(state, clock, scale, quorum)
    for lid in "ab":
        sync.join(JoinRequest(learner_id=lid))
    sync.init(codec.encode({"w": torch.zeros(2)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    beat(sync, "a")
    beat(sync, "b")
    return sync


def theta(sync: Synchronizer) -> torch.Tensor:
    return codec.decode(sync.fragment(0)[1])["w"]


@pytest.mark.parametrize("scale", ["contributors", "live"])
def test_two_k1_merges_of_a_two_learner_live_set(tmp_path: Path, scale: str) -> None:
    """K = 1, one contributor per merge: `contributors` adds both deltas (the sum), `live`
    halves each, so the two merges equal one mean merge of both (K = M)."""
    sync = started(tmp_path, Clock(), scale)
    assert sync.submit(update("a", A, base=0)).status == "accepted"
    assert sync.merge(0) == 1
    assert sync.submit(update("b", B, base=0)).status == "accepted"  # based one version back
    assert sync.merge(0) == 2
    want = (A + B) / 2 if scale == "live" else A + B
    assert torch.allclose(theta(sync), want)
    assert sync.status().mean_merge_scale == pytest.approx(0.5 if scale == "live" else 1.0)


def test_live_scaled_k1_equals_one_synchronous_mean_merge(tmp_path: Path) -> None:
    k1 = started(tmp_path / "k1", Clock(), "live")
    for lid, value in (("a", A), ("b", B)):
        assert k1.submit(update(lid, value, base=0)).status == "accepted"
        assert k1.merge(0) is not None
    km = started(tmp_path / "km", Clock(), "live", quorum=2)
    for lid, value in (("a", A), ("b", B)):
        assert km.submit(update(lid, value, base=0)).status == "accepted"
    assert km.merge(0) == 1  # both in one merge: the whole live set, scale 1
    assert km.status().mean_merge_scale == 1.0
    # one contributor's RDA is its own delta, so K = M's merge of equal weights is here
    # the RDA of A and B, not their mean; compare against the mean rule's K = M instead
    mean = started(tmp_path / "mean", Clock(), "live", quorum=2)
    mean.fragments[0].shared.policy = MergePolicy(
        rule="mean", scale="live", outer=mean.policy.outer
    )
    for lid, value in (("a", A), ("b", B)):
        mean.submit(update(lid, value, base=0))
    assert mean.merge(0) == 1
    assert torch.allclose(theta(k1), theta(mean))


def test_a_learner_gone_silent_leaves_the_live_set(tmp_path: Path) -> None:
    clock = Clock()
    sync = started(tmp_path, clock, "live")
    assert sync.submit(update("b", B, base=0)).status == "accepted"
    assert sync.merge(0) == 1  # a and b live: half of B
    assert torch.allclose(theta(sync), B / 2)
    clock.now += sync.settings.liveness_s + 1  # b dies; only a speaks
    beat(sync, "a")
    assert sync.submit(update("a", A, base=1)).status == "accepted"
    assert sync.merge(0) == 2
    assert torch.allclose(theta(sync), B / 2 + A)  # a alone is the whole live set


def test_the_live_set_token_mass_survives_a_restart(tmp_path: Path) -> None:
    """b hands over 3x a's tokens. After a restart (a fresh process on the same state) a's
    lone merge is scaled by 100 / 400 from the ledger's record of b, not 100 / 200 as if b
    were unknown (counted at the others' mean)."""
    clock = Clock()
    sync = started(tmp_path, clock, "live")
    assert sync.submit(update("a", A, base=0, tokens=100)).status == "accepted"
    assert sync.submit(update("b", B, base=0, tokens=300)).status == "accepted"
    assert sync.merge(0) == 1  # whole live set: scale 1
    sync.close()
    again = sync_for(tmp_path, clock, "live")
    beat(again, "a")
    beat(again, "b")
    before = theta(again).clone()
    assert again.submit(update("a", A, base=1, tokens=100, step=20)).status == "accepted"
    assert again.merge(0) == 2
    assert torch.allclose(theta(again) - before, A * 0.25)


def test_the_policy_scales_by_capped_tokens_and_never_above_one() -> None:
    policy = MergePolicy(rule="mean", scale="live", counter_cap_steps=10)
    params, momentum = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    spec = LAYOUT.fragments[0]
    # 20 steps, 200 tokens, capped to 10 steps, 100 tokens: 100 / 400
    c = Contribution({"w": A.clone()}, steps=20, tokens=200, base_version=0)
    out = policy.merge(spec, params, momentum, 0, [c], live_tokens=400.0)
    assert out is not None and out.scale == pytest.approx(0.25)
    c = Contribution({"w": A.clone()}, steps=10, tokens=100, base_version=0)
    out = policy.merge(spec, params, momentum, 0, [c], live_tokens=50.0)
    assert out is not None and out.scale == 1.0  # more than the live mass: not amplified
    plain = MergePolicy(rule="mean", counter_cap_steps=10)
    out = plain.merge(spec, params, momentum, 0, [c], live_tokens=400.0)
    assert out is not None and out.scale == 1.0  # `contributors` ignores the live mass
