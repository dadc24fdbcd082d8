"""Config loading: TOML tables map onto the dataclasses, flags override, bad input is named."""

import pytest

from p2pdiloco.config import ConfigError, fingerprint_diff, load_config, parse_set


def test_defaults_and_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nn_layer = 3\n[swarm]\nround_steps = 7\ninitial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/x"]\n')
    cfg = load_config(path, [parse_set(["model.n_layer=5", "outer.nesterov=false", "inner.lr=1e-3"])])
    assert cfg.model.n_layer == 5
    assert cfg.swarm.round_steps == 7
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
