"""Named sets of settings that only work together (`--recipe NAME`), applied over the config file and under the
flags and `--set`s, so any of them can still be overridden.

sparseloco: SparseLoCo (arXiv 2508.15706) replaces the outer momentum with a decayed error feedback accumulator
(β = 0.95) and steps by the plain average. Its outer lr of 3 is larger than fp32 DiLoCo's: an average of sparse
parts that mostly do not overlap moves each value by a fraction of one member's, and only the larger step makes up
for it. Eager updates are off: they would jump by that lr times the peer's own dense Δ, three times its own
progress. It keeps all the steps taken while a merge is in flight (`outer.rebase_keep` = 1). The runs that chose
each setting are in docs/experiments.md ("Recipe variants"); docs/benchmarks.md, "Sparse pseudo-gradients",
has what it gives at each H.
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
