"""Named sets of settings that only work together (`--recipe NAME`), applied over the config file and under the
flags and `--set`s, so any of them can still be overridden.

sparseloco: SparseLoCo (arXiv 2508.15706) replaces the outer momentum with a decayed error feedback accumulator
(β = 0.95) and steps by the plain average. The outer lr was picked by single runs here (4 decoupled peers, 1000
steps; eval loss at H = 10 with lr 1, 2, 3, 4: 2.31, 2.15, 2.08, 2.15; at H = 50 with lr 1, 2, 4, 6: 2.41, 2.38,
2.37, 2.49; fp32 DiLoCo 2.23 and 2.16). With the Nesterov outer step of fp32 DiLoCo (lr 0.7, momentum 0.9)
sparseloco reached 2.70 at H = 50: an average of sparse parts that mostly do not overlap moves each value by a
fraction of one member's, and only the larger step makes up for it. Eager updates (on by default) jump by that lr
times the peer's own dense Δ, three times its own progress: at H = 10 sparseloco reached 2.2857 with them and
2.0576 without (single runs at e3659c3). It was measured keeping all the steps taken while a merge is in flight
(`outer.rebase_keep` = 1) and keeps them: with the default's 0.5 it did worse. docs/benchmarks.md, "Sparse
pseudo-gradients", has what it gives at each H.
"""

from __future__ import annotations

from p2pdiloco.config.schema import ConfigError

RECIPES: dict[str, list[str]] = {
    "sparseloco": ["codec.name=sparseloco", "codec.error_feedback_decay=0.95", "outer.momentum=0", "outer.lr=3",
                   "outer.eager=false", "outer.rebase_keep=1"],
}


def recipe_sets(name: str | None) -> list[str]:
    """The `section.key=value` settings of recipe `name` (none for None); ConfigError naming the known recipes."""
    if name is None:
        return []
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r} (known: {', '.join(sorted(RECIPES))})")
    return list(RECIPES[name])
