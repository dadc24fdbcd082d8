"""Names of the algorithm's interchangeable parts, defined once here and imported by the config that picks
among them. Kept free of torch so that reading a config (and `p2pdiloco --help`) does not load it."""

CODECS = ("none", "fp16", "bf16", "int8", "int4", "sparseloco")
"""Merge payload codecs (see codecs.py; config field codec.name)."""
AGGREGATORS = ("mean", "centered_clip", "trimmed_mean", "rda")
"""Rules that combine a merge group's contributions (see robust.py; config field guard.aggregate)."""
OPTIMIZERS = ("adamw", "adamw8bit")
"""Inner optimizers (see training/optim.py; config field inner.optimizer)."""
PRECISIONS = ("auto", "fp32", "bf16")
"""Inner-step compute precisions (see training/accel.py; config field run.precision)."""
ARCHS = ("gpt", "llama")
"""Model architectures (see training/model.py and training/llama.py; config field model.arch)."""
HOSTILE_KINDS = ("nan", "scale", "noise", "signflip", "takeover", "final", "leader", "donor",
                 "sybil_donor", "grinder", "pinner", "flood")
"""How a hostile peer attacks (testing/hostile.py; config field emulate.hostile): the first four corrupt its
pseudo-gradients, the others lie about itself (its model and weights, the end of its run, its leadership, the
state it serves, alone or with other ids) or abuse the swarm's rules (a ground id, pinned state slots, a flood of
valid requests)."""
