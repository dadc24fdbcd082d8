"""p2pdiloco: DiLoCo-style training on volunteer compute over a hivemind DHT."""

__version__ = "0.1.0"
