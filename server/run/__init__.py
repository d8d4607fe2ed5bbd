"""A run's records: the round record, the run folder's layout, the recorder and the plot."""
