"""Configuration: defaults <- YAML <- overrides, and one clear line for every mistake."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from diloco.config import Config, ConfigError, load_config, save_config
from diloco.config.trust import trust_line


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  lr: 0.002\n  steps: 40\nouter:\n  sync_every: 10\n")
    cfg = load_config(path, ["inner.lr=0.003", "comm.hivemind.initial_peers=['/ip4/1.2.3.4/tcp/5/p2p/abc']"])
    assert cfg.inner.lr == 0.003  # the command line wins over the file
    assert cfg.inner.steps == 40 and cfg.outer.sync_every == 10  # the file wins over the defaults
    assert cfg.model.n_embd == 128 and cfg.outer.optimizer == "nesterov"  # defaults
    assert cfg.comm.hivemind.initial_peers == ["/ip4/1.2.3.4/tcp/5/p2p/abc"]


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["seed=7", "outer.lr=0.5"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["inner.lrr=1"], "inner.lrr"),
        (["nonsense=1"], "nonsense"),
        (["inner.steps=many"], "inner.steps"),
        (["outer.optimizer=lion"], "outer.optimizer"),
        (["outer.sync_every=-1"], "outer.sync_every"),
        (["logging.wandb=sometimes"], "logging.wandb"),
        (["model.n_head=3"], "model.n_head"),
        (["worker.index=2", "worker.count=2"], "worker.index"),
        (["comm.hivemind.request_timeout_s=9", "comm.hivemind.matchmaking_s=5"], "comm.hivemind.request_timeout_s"),
        (["comm.hivemind.heartbeat_s=0.1"], "comm.hivemind.heartbeat_s"),
        (["comm.backend=carrier_pigeon"], "comm.backend"),
        (["comm.hivemind.initial_peers=[garbage]"], "comm.hivemind.initial_peers"),
        (["inner.lr"], "KEY=VALUE"),
        (["checkpoint.keep=0"], "checkpoint.keep=0 must be at least 1"),
        (["logging.eval_batches=0"], "logging.eval_batches=0 must be at least 1"),
        (["logging.eval_batch_size=0"], "logging.eval_batch_size=0 must be at least 1"),
    ],
)
def test_each_mistake_names_its_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert expected in message and "\n" not in message


def _list_keys(node=None, prefix: str = "") -> list[str]:
    """Every list-typed key of the schema, found by walking it."""
    node = OmegaConf.structured(Config) if node is None else node
    keys = []
    for name in node:
        if OmegaConf.is_dict(node[name]):
            keys += _list_keys(node[name], f"{prefix}{name}.")
        elif OmegaConf.is_list(node[name]):
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize("key", _list_keys())
def test_every_list_key_given_a_scalar_or_a_mapping_shows_the_list_to_write(tmp_path, key):
    assert "comm.hivemind.initial_peers" in _list_keys()
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=a,b"])
    assert str(info.value) == f"{key} must be a list: {key}=\"['a','b']\""
    with pytest.raises(ConfigError, match=re.escape(f"{key} must be a list: {key}=\"['...']\"")):
        load_config(None, [f"{key}={{x: 1}}"])  # omegaconf alone: a TypeError's traceback
    section, name = key.rsplit(".", 1)
    path = tmp_path / "c.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{section}.{name}=one"])))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}: {key} must be a list: {name}: ['one'] in the file"


def test_a_section_given_a_value_is_named_a_section_and_an_empty_one_in_a_file_sets_nothing(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["inner=5"])
    assert str(info.value) == (
        "inner is a section, not a value (5 given): set its keys, such as inner.steps=... "
        "(`diloco config` prints every key)"
    )
    path = tmp_path / "c.yaml"
    path.write_text("comm:\n  hivemind: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {path}: comm.hivemind is a section, not a value")):
        load_config(path)
    path.write_text("inner:\n  # steps: 40\nouter:\n  lr: 0.5\n")  # every key of inner commented out
    assert load_config(path) == load_config(None, ["outer.lr=0.5"])


def test_a_directory_as_the_config_file_is_named_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"config file {tmp_path} is a directory, not a YAML config file")):
        load_config(tmp_path)


def test_missing_or_malformed_yaml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match="inner.lrr"):
        load_config(unknown)


@pytest.mark.parametrize(
    ("old", "value", "taken"),
    [
        ("initial_peers", "['/ip4/1.2.3.4/tcp/5/p2p/abc']", ["/ip4/1.2.3.4/tcp/5/p2p/abc"]),
        ("host", "0.0.0.0", "0.0.0.0"),
        ("matchmaking_s", "8", 8.0),
        ("data_plane", "gloo", "gloo"),
    ],
)
def test_a_key_that_moved_to_comm_hivemind_is_an_error_naming_its_new_place_in_an_override_and_in_a_file(
    tmp_path, old, value, taken
):
    """The same one line wherever the old key is written; under comm.hivemind it is taken as it is."""
    expected = f"comm.{old} is now comm.hivemind.{old}"
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        load_config(None, [f"comm.{old}={value}"])
    assert "\n" not in str(info.value)
    path = tmp_path / "old.yaml"
    path.write_text(f"comm:\n  deadline_s: 30\n  {old}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}: {expected}: move it under `comm: hivemind:` in the file"
    path.write_text(f"comm:\n  deadline_s: 30\n  hivemind:\n    {old}: {value}\n")  # where it is now
    assert getattr(load_config(path).comm.hivemind, old) == taken


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "inner.lrr=1"],
        ["local", "--workers", "2", "outer.optimizer=lion"],
        ["train", "data.path=/no/such/file.txt"],
        ["config", "/no/such/config.yaml"],
    ],
)
def test_cli_reports_bad_input_in_one_line_with_exit_code_2(argv, diloco_cli):
    done = diloco_cli(*argv, timeout=120)  # its output: stdout and stderr, as a terminal shows them
    assert done.returncode == 2, done.stdout
    assert "Traceback" not in done.stdout
    errors = [line for line in done.stdout.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1, done.stdout


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["comm.backend=simulator"], "worker.site=true syncs sites over hivemind"),
        (["outer.sync_every=0"], "worker.site=true needs rounds"),
        (["outer.overlap=delayed"], "worker.site=true runs blocking rounds"),
    ],
)
def test_a_site_needs_hivemind_and_blocking_rounds(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["worker.site=true", *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["worker.site=true", "worker.site_sharding=zero3"], "worker.site_sharding='zero3' is not one of ddp, fsdp"),
        (["worker.site_sharding=fsdp"], "worker.site_sharding=fsdp needs worker.site=true"),
    ],
)
def test_a_site_sharding_is_ddp_or_fsdp_and_only_for_sites(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_bare_key_on_the_command_line_is_the_empty_string():
    assert load_config(None, ["data.path=", "run.dir="]).data.path == ""
    with pytest.raises(ConfigError, match="inner.lr"):
        load_config(None, ["inner.lr="])


def test_the_simulators_earlier_name_is_still_read_as_the_simulator(tmp_path):
    assert load_config(None, ["comm.backend=inproc"]).comm.backend == "simulator"
    saved = tmp_path / "config.yaml"
    saved.write_text("comm:\n  backend: inproc\n")  # a run directory's config.yaml from before
    assert load_config(saved).comm.backend == "simulator"


@pytest.mark.parametrize(
    ("overrides", "screened"),
    [
        ([], False),  # on loopback: trusted
        (["comm.hivemind.host=0.0.0.0"], True),  # others can reach it: open
        (["comm.hivemind.host=0.0.0.0", "comm.trust=trusted"], False),  # unless the organizer says so
        (["comm.hivemind.initial_peers=['/ip4/10.1.2.3/tcp/4000/p2p/QmX']"], True),  # it dials another machine
        (["comm.hivemind.announce_host=203.0.113.7"], True),
        (["comm.hivemind.host=0.0.0.0", "comm.backend=simulator"], False),
        (["comm.hivemind.host=0.0.0.0", "worker.site=true"], False),
        (["comm.hivemind.host=0.0.0.0", "comm.hivemind.data_plane=gloo"], False),
        (["comm.hivemind.host=0.0.0.0", "outer.sync_every=0"], False),
        (["comm.trust=open"], True),
        (["comm.trust=keyed", "comm.run_key=k"], True),
        (["comm.trust=open", "comm.backend=simulator"], True),  # the attack benchmark's runs
    ],
)
def test_the_trust_level_picks_the_screening_defaults(overrides, screened):
    cfg = load_config(None, overrides)
    assert (cfg.comm.min_cosine, cfg.comm.clip_to_median) == ((0.0, True) if screened else (-1.0, False))


def test_the_level_a_run_takes_by_where_it_listens_is_written_into_its_config_and_said_in_one_line(tmp_path):
    reachable = load_config(None, ["comm.hivemind.host=0.0.0.0"])
    assert reachable.comm.trust == "open"
    line = trust_line(reachable)
    assert line.startswith("comm.trust=open (others can reach this run (it listens on 0.0.0.0))")
    assert "the run has no key: anyone who reaches it can join and download its params" in line
    save_config(reachable, tmp_path / "config.yaml")
    resumed = load_config(tmp_path / "config.yaml", ["comm.hivemind.host=127.0.0.1"])
    assert resumed.comm.trust == "open" and "set in the run's config" in trust_line(resumed)
    local = load_config(None, [])
    assert local.comm.trust == "trusted"
    assert trust_line(local).startswith("comm.trust=trusted (only this machine can reach this run")
    keyed = load_config(None, ["comm.hivemind.host=0.0.0.0", "comm.run_key=k"])
    assert "no key" not in trust_line(keyed)


def test_a_screening_key_set_by_the_user_wins_over_the_trust_level_and_a_written_config_keeps_its_own(tmp_path):
    cfg = load_config(None, ["comm.min_cosine=0.2", "comm.trust=open"])
    assert (cfg.comm.min_cosine, cfg.comm.clip_to_median) == (0.2, True)
    save_config(load_config(None, ["comm.trust=open", "comm.clip_to_median=false"]), tmp_path / "config.yaml")
    resumed = load_config(tmp_path / "config.yaml")
    assert (resumed.comm.trust, resumed.comm.min_cosine, resumed.comm.clip_to_median) == ("open", 0.0, False)


def test_a_trust_level_on_the_command_line_outranks_the_screening_keys_of_a_file_not_those_beside_it(tmp_path):
    save_config(load_config(None, []), tmp_path / "trusted.yaml")  # a written config sets every key
    save_config(load_config(None, ["comm.trust=open"]), tmp_path / "open.yaml")
    screening = lambda cfg: (cfg.comm.trust, cfg.comm.min_cosine, cfg.comm.clip_to_median)  # noqa: E731
    assert screening(load_config(tmp_path / "trusted.yaml", ["comm.trust=open"])) == ("open", 0.0, True)
    assert screening(load_config(tmp_path / "open.yaml", ["comm.trust=trusted"])) == ("trusted", -1.0, False)
    assert screening(load_config(tmp_path / "open.yaml")) == ("open", 0.0, True)
    beside = load_config(tmp_path / "trusted.yaml", ["comm.trust=open", "comm.min_cosine=0.2"])
    assert screening(beside) == ("open", 0.2, True)


def test_a_written_configs_masked_key_stands_for_the_key_held_elsewhere(tmp_path, monkeypatch):
    from diloco.comm.run_key_env import resolve_run_key

    monkeypatch.delenv("DILOCO_RUN_KEY", raising=False)
    save_config(load_config(None, ["comm.trust=keyed", "comm.run_key=s3cret"]), tmp_path / "config.yaml")
    assert "s3cret" not in (tmp_path / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="comm.trust=keyed needs the run's key"):
        load_config(tmp_path / "config.yaml")  # the mask is no key
    monkeypatch.setenv("DILOCO_RUN_KEY", "s3cret")
    cfg = load_config(tmp_path / "config.yaml")
    assert resolve_run_key(cfg.comm.run_key) == "s3cret"  # not the mask, as the run's HMAC key


def test_a_keyed_run_needs_its_key_and_a_level_the_transport_cannot_apply_is_refused(monkeypatch):
    monkeypatch.delenv("DILOCO_RUN_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=r"comm.trust=keyed needs the run's key: set comm.run_key or \$DILOCO_RUN_KEY"
    ):
        load_config(None, ["comm.trust=keyed"])
    load_config(None, ["comm.trust=keyed", "comm.backend=simulator"])  # one process: no key to hold
    monkeypatch.setenv("DILOCO_RUN_KEY", "k")
    load_config(None, ["comm.trust=keyed"])
    with pytest.raises(ConfigError, match="comm.trust='strangers' is not one of trusted, keyed, open"):
        load_config(None, ["comm.trust=strangers"])
    for transport in ("comm.hivemind.data_plane=gloo", "comm.backend=torchdist", "outer.sync_every=0"):
        with pytest.raises(ConfigError, match="set comm.trust=trusted"):
            load_config(None, ["comm.trust=open", transport])
