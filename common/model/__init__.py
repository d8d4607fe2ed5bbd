"""The frozen base: loading and fingerprint, the embedded default, int8 layers, attention."""
