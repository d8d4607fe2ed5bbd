"""What client and server share about a run: its config, the wire's keys and replies, the heads <-> Flower record codec."""
