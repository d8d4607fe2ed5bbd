"""Files to chunks (the only chunker), cached base features, self-distilled chunks."""
