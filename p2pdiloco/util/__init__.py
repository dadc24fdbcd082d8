"""The lowest layer: small helpers every other layer may use, with no p2pdiloco imports of their own."""
