"""The run store: what the ServerApp records about a federated run, and what the dashboard reads."""
