"""The shipped presets: loadable by name, equal to the operator-facing copies in peers/, and of the sizes
their headers promise (counted on the meta device: no memory is allocated for the 1B model)."""

from pathlib import Path

import pytest
import torch

from p2pdiloco.cli import main
from p2pdiloco.config import Config, ConfigError, load_config, parse_set
from p2pdiloco.config.presets import preset_names, preset_path
from p2pdiloco.training.llama import Llama
from p2pdiloco.training.model import GPT, count_params

PEERS = Path(__file__).resolve().parent.parent / "peers"


def test_presets_ship_in_the_package_and_match_peers_folder():
    assert preset_names() == ["medium", "small", "tiny"]
    for name in preset_names():
        assert preset_path(name).read_text() == (PEERS / f"{name}.toml").read_text(), name
    with pytest.raises(ConfigError, match="known: medium, small, tiny"):
        preset_path("huge")


def test_tiny_is_the_defaults():
    assert load_config(preset_path("tiny")) == Config()


@pytest.mark.parametrize(("name", "low", "high", "optimizer", "codec", "h"), [
    ("tiny", 0.3e6, 0.6e6, "adamw", "int4", 50),
    ("small", 115e6, 135e6, "adamw", "int8", 500),
    ("medium", 0.95e9, 1.1e9, "adamw8bit", "int8", 500),
])
def test_preset_sizes_and_recommendations(name, low, high, optimizer, codec, h):
    cfg = load_config(preset_path(name))
    with torch.device("meta"):
        n = count_params({"gpt": GPT, "llama": Llama}[cfg.model.arch](cfg.model))
    assert low <= n <= high
    assert f"{n:,} parameters" in preset_path(name).read_text().splitlines()[0]  # the header says the count
    assert (cfg.inner.optimizer, cfg.codec.name, cfg.rounds.round_steps) == (optimizer, codec, h)
    if name != "tiny":
        assert cfg.swarm.run_id == name and cfg.run.precision == "auto"


def test_cli_preset_flag(capsys):
    assert main(["peer", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    assert main(["peer", "--preset", "tiny", "--config", "x.toml"]) == 2
    assert "not both" in capsys.readouterr().err


def test_every_preset_names_every_config_key():
    for name in preset_names():
        text = preset_path(name).read_text()
        for section, info in Config.model_fields.items():
            assert f"\n[{section}]\n" in text, f"{name}.toml lacks [{section}]"
            for key in info.annotation.model_fields:
                if key not in ("resume", "hostile"):  # one restart; a test and bench role: not a swarm property
                    assert f"\n{key} = " in text, f"{name}.toml lacks {section}.{key}"


def _args(*argv: str):
    from p2pdiloco.cli import build_parser

    return build_parser().parse_args(["local", *argv])


def test_recipe_sets_its_settings_over_the_config_and_under_set():
    from p2pdiloco.app.commands import config_from_args, user_sets

    cfg = config_from_args(_args("--preset", "small", "--recipe", "sparseloco"))
    assert (cfg.codec.name, cfg.codec.error_feedback_decay, cfg.outer.momentum, cfg.outer.lr, cfg.outer.eager,
            cfg.outer.rebase_keep) == ("sparseloco", 0.95, 0.0, 3.0, False, 1.0)
    assert (cfg.model.d_model, cfg.rounds.round_steps) == (768, 500)  # the rest is the preset's
    over = _args("--recipe", "sparseloco", "--set", "outer.lr=4", "--set", "rounds.round_steps=20")
    cfg = config_from_args(over)
    assert (cfg.outer.lr, cfg.rounds.round_steps, cfg.outer.momentum) == (4.0, 20, 0.0)
    # `local` hands its peers the recipe's settings first, so a --set still wins there too
    peers_cfg = load_config(None, [parse_set(user_sets(over))])
    assert (peers_cfg.outer, peers_cfg.swarm) == (cfg.outer, cfg.swarm)
    assert config_from_args(_args()).codec.name == "int4"  # no recipe, no change


def test_cli_unknown_recipe_is_refused(capsys):
    assert main(["peer", "--recipe", "dense"]) == 2
    assert "unknown recipe 'dense' (known: sparseloco)" in capsys.readouterr().err


def test_every_recipe_names_known_keys_and_good_values():
    from p2pdiloco.config.recipes import RECIPES, recipe_sets

    for name in RECIPES:
        cfg = load_config(None, [parse_set(recipe_sets(name))])
        assert cfg != Config(), name
