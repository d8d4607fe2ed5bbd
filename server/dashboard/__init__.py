"""The read-only web dashboard over the run store (JSON API, HTML pages, checkpoint downloads)."""
