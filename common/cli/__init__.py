"""The `fedla` command: client/ and server/ plug their commands in through entry points."""
