"""Training the heads: loss and loop, and the public heads every run starts from."""
