"""A device's local training: one round, DP-SGD or plain, and the privacy it spends."""
