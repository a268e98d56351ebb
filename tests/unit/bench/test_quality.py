"""``diloco bench quality``'s rows: every arm over DDP, and the Muon arms over DDP under Muon too."""

from __future__ import annotations

import pytest

from diloco.bench.quality import ARMS, DDP_MUON, _collect, _table


def _run(arm: str, loss: float, sent: int) -> dict:
    return {"arm": arm, "seed": 0, "final_val_loss": loss, "bytes_sent": sent, "workers": 4, "step_ms": 12.34}


def test_muon_arms_train_with_muon_and_are_compared_with_ddp_under_adamw_and_under_muon():
    by_name = {arm.name: arm for arm in ARMS}
    assert "inner.optimizer=muon" in by_name["m4-h50-muon"].extra and by_name[DDP_MUON].sync_every == 0
    assert "inner.optimizer=muon" not in by_name["m4-h50-lr1.0-m0.8"].extra
    assert {"inner.optimizer=muon", "outer.optimizer=sparseloco"} <= set(by_name["m4-h50-muon-sparseloco"].extra)
    assert "compression.name=int4" in by_name["m4-h50-muon-int4"].extra
    results = _collect([_run("ddp", 2.0, 1000), _run(DDP_MUON, 1.9, 1000), _run("m4-h50-muon", 1.95, 20)])
    row = results["arms"]["m4-h50-muon"]
    assert row["ratio_to_ddp"] == pytest.approx(0.975) and row["ratio_to_ddp_muon"] == pytest.approx(1.95 / 1.9)
    assert "| m4-h50-muon | 4 | 50 | 1.9500 | 0.975 | 1.026 | 20 | 50 x | 12.3 |" in _table(results)
