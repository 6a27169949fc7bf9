"""A run directory, opened as someone else may have left it: one door, and the file and trust rules behind it."""
