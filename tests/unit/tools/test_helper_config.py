"""``diloco helper``'s config: a helper given a config file of its own reduces by the run's rules or not at all."""

from __future__ import annotations

import pytest

from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.config import ConfigError, load_config, save_config
from diloco.tools import helper
from diloco.worker.joining import published_run


def test_a_helper_whose_config_screens_otherwise_than_the_run_is_refused_in_one_line(tmp_path, monkeypatch):
    run = published_run(load_config(None, ["comm.trust=open"]))  # as a worker announces it
    live = {0: RosterEntry(index=0, round=2, step=40, run=run)}
    monkeypatch.setattr(helper, "_announced", lambda cfg, wait_s, config: live)  # the roster a DHT read returns
    save_config(load_config(None, []), tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="comm.trust='trusted' here, 'open' in the run"):
        helper.helper_config(str(tmp_path / "config.yaml"), [], wait_s=1.0)
    cfg, _ = helper.helper_config(str(tmp_path / "config.yaml"), ["comm.trust=open"], wait_s=1.0)
    assert cfg.comm.min_cosine == 0.0
