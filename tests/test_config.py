"""Config loading: TOML tables map onto the typed models, flags override, bad input is named."""

from pathlib import Path

import pytest

from p2pdiloco.config import ALIASES, Config, ConfigError, fingerprint_diff, load_config, parse_set


def test_defaults_and_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nn_layer = 3\n[swarm]\nround_steps = 7\ninitial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/x"]\n')
    cfg = load_config(path, [parse_set(["model.n_layer=5", "outer.nesterov=false", "inner.lr=1e-3"])])
    assert cfg.model.n_layer == 5
    assert cfg.rounds.round_steps == 7
    assert cfg.swarm.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/x"]
    assert cfg.outer.nesterov is False
    assert cfg.inner.lr == 1e-3
    assert cfg.outer.lr == 0.7 and cfg.outer.momentum == 0.9


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_layers = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.n_layers'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"unknown config section \[modle\]"):
        load_config(None, [parse_set(["modle.n_layer=2"])])


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match="model.n_layer.*expects int"):
        load_config(None, [parse_set(["model.n_layer=two"])])
    with pytest.raises(ConfigError, match="divisible"):
        load_config(None, [parse_set(["model.d_model=100", "model.n_head=3"])])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set(["n_layer=2"])
    with pytest.raises(ConfigError, match="data.shard"):
        load_config(None, [parse_set(["data.shard=3/2"])])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")


def test_fingerprint_diff_names_the_key():
    a = load_config(None, [parse_set(["model.n_layer=2"])]).fingerprint()
    b = load_config(None, [parse_set(["model.n_layer=4"])]).fingerprint()
    assert fingerprint_diff(a, b) == ["model.n_layer: 2 here, 4 in the swarm"]
    assert fingerprint_diff(a, a) == []


def test_an_epoch_length_other_than_the_old_30_s_is_part_of_the_fingerprint():
    """Peers deal groups by the epoch: with other lengths they would expect other mates. Peers that predate the key
    dealt every 30 s, so only another length is named (the default's fingerprint did not change)."""
    default, long = load_config(None, []).fingerprint(), load_config(None, [parse_set(["merge.epoch_s=300"])]).fingerprint()
    assert "epoch_s" not in default["rounds"]
    assert fingerprint_diff(long, default) == ["rounds.epoch_s: 300.0 here, None in the swarm"]
    with pytest.raises(ConfigError, match="merge.epoch_s >= 1"):
        load_config(None, [parse_set(["merge.epoch_s=0.5"])])


def test_old_emulation_keys_are_aliases_of_the_emulate_section(tmp_path):
    assert {old: new for old, new in ALIASES.items() if old.startswith("run.")} == {
        "run.slow_factor": "emulate.slow_factor",
        "run.min_step_s": "emulate.min_step_s",
        "run.hostile": "emulate.hostile",
    }
    path = tmp_path / "c.toml"
    path.write_text('[run]\nslow_factor = 2.5\nmin_step_s = 0.1\nhostile = "nan"\n')
    from_toml = load_config(path)
    from_flags = load_config(None, [parse_set(["run.slow_factor=2.5", "run.min_step_s=0.1", "run.hostile=nan"])])
    new_keys = load_config(None, [parse_set(["emulate.slow_factor=2.5", "emulate.min_step_s=0.1",
                                             "emulate.hostile=nan"])])
    for cfg in (from_toml, from_flags, new_keys):
        assert (cfg.emulate.slow_factor, cfg.emulate.min_step_s, cfg.emulate.hostile) == (2.5, 0.1, "nan")
        assert cfg.run == Config().run and not hasattr(cfg.run, "slow_factor")
    assert load_config(path, [parse_set(["emulate.slow_factor=3"])]).emulate.slow_factor == 3.0  # flags win
    with pytest.raises(ConfigError, match="emulate.slow_factor must be >= 1"):
        load_config(None, [parse_set(["run.slow_factor=0.5"])])
    with pytest.raises(ConfigError, match="emulate.hostile must be nan, scale, noise, signflip, takeover, final, leader, donor, grinder, pinner or flood"):
        load_config(None, [parse_set(["run.hostile=evil"])])


SWARM_ALIASES = {
    "swarm.round_steps": ("rounds.round_steps", 7),
    "swarm.round_seconds": ("rounds.round_seconds", 12.5),
    "swarm.sync": ("rounds.sync", True),
    "swarm.merge_window_s": ("merge.merge_window_s", 40.0),
    "swarm.window_fraction": ("merge.window_fraction", 0.5),
    "swarm.min_window_s": ("merge.min_window_s", 2.0),
    "swarm.merge_timeout_s": ("merge.merge_timeout_s", 90.0),
    "swarm.group_size": ("merge.group_size", 4),
    "swarm.epoch_s": ("merge.epoch_s", 300.0),
    "swarm.state_anchors": ("merge.state_anchors", 3),
    "swarm.codec": ("codec.name", "sparseloco"),
    "swarm.sparse_keep": ("codec.sparse_keep", 64),
    "swarm.error_feedback": ("codec.error_feedback", False),
    "swarm.error_feedback_decay": ("codec.error_feedback_decay", 0.95),
    "swarm.wait_for_peers": ("startup.wait_for_peers", 3),
    "swarm.wait_for_peers_s": ("startup.wait_for_peers_s", 30.0),
}
"""Every key that moved out of `[swarm]`, the key it sets now, and a value other than its default."""


def _value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_every_old_swarm_key_sets_the_same_value_as_its_new_key(tmp_path):
    assert {old: new for old, new in ALIASES.items() if old.startswith("swarm.")} == {
        old: new for old, (new, _) in SWARM_ALIASES.items()}
    for old, (new, value) in SWARM_ALIASES.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        by_new = load_config(None, [parse_set([f"{new}={text}"])])
        by_old = load_config(None, [parse_set([f"{old}={text}"])])
        path = tmp_path / "old.toml"
        path.write_text(f"[swarm]\n{old.split('.')[1]} = {value!r}\n".replace("True", "true").replace("False", "false")
                        .replace("'", '"'))
        from_toml = load_config(path)
        assert _value(by_new, new) == value != _value(Config(), new), old
        assert by_old == by_new == from_toml, old
    with pytest.raises(ConfigError, match="merge.epoch_s >= 1"):  # an old key's bad value is named by its new key
        load_config(None, [parse_set(["swarm.epoch_s=0.5"])])
    with pytest.raises(ConfigError, match="unknown config key 'swarm.name'"):
        load_config(None, [parse_set(["swarm.name=int8"])])


def test_a_config_recorded_before_the_swarm_was_split_loads_as_it_was():
    """Summaries and checkpoints record `Config.to_dict`; one written with the single `[swarm]` table (every
    component's keys in it) loads through the aliases to the config it recorded, and to its fingerprint."""
    from p2pdiloco.app.saved_model import recorded_config

    new = load_config(None, [parse_set([f"{new}={str(value).lower() if isinstance(value, bool) else value}"
                                        for new, value in SWARM_ALIASES.values()])])
    old = new.to_dict()
    old["swarm"] = {**old["swarm"], **{o.split(".")[1]: _value(new, n) for o, (n, _) in SWARM_ALIASES.items()}}
    for section in ("rounds", "merge", "codec", "startup"):
        del old[section]
    assert len(old["swarm"]) == 24
    assert recorded_config(old, Path("summary.json")) == new == recorded_config(new.to_dict(), Path("summary.json"))


def test_bad_values_in_every_section_are_one_line_config_errors():
    for item, message in [
        ("guard.aggregate=median", "guard.aggregate must be mean, centered_clip, trimmed_mean or rda"),
        ("codec.name=int2", "codec.name must be one of none, fp16, bf16, int8, int4"),
        ("run.precision=fp8", "run.precision must be one of auto, fp32, bf16"),
        ("inner.optimizer=sgd", "inner.optimizer must be one of adamw, adamw8bit"),
        ("outer.lr=0", "learning rates must be positive"),
        ("outer.rebase_keep=1.5", r"outer.rebase_keep must be in \[0, 1\]"),
        ("outer.land_wait=-0.1", r"outer.land_wait must be in \[0, 1\]"),
        ("run.cpu_affinity=a,b", "run.cpu_affinity must be comma-separated CPU ids"),
        ("merge.min_window_s=20", "need 0 < merge.min_window_s <= merge_window_s"),
        ("outer.nesterov=maybe", "config key 'outer.nesterov' expects bool"),
    ]:
        with pytest.raises(ConfigError, match=message) as e:
            load_config(None, [parse_set([item])])
        assert "\n" not in str(e.value), item
    with pytest.raises(ConfigError, match="unknown config key 'model.x'"):
        Config(model={"x": 1})  # the models check when built directly, too


def test_sparse_peers_from_before_the_momentum_screen_are_told_apart():
    """Sparse parts are screened against the momentum by every member alike; a sparse peer without that screen
    would leave out other parts and fork the group's model, so its fingerprint must differ, by a named key."""
    new = load_config(None, [parse_set(["codec.name=sparseloco"])]).fingerprint()
    old = {**new, "codec": {k: v for k, v in new["codec"].items() if k != "sparse_screen"}}
    assert fingerprint_diff(new, old) == ["codec.sparse_screen: 'momentum' here, None in the swarm"]
    assert "sparse_screen" not in load_config(None, []).fingerprint()["codec"]  # int4 swarms: unchanged
