"""The draft model: lookahead heads with their fusion head, the EAGLE drafter, low-rank updates, the draft vocabulary."""
