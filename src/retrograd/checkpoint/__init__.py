"""Checkpoints: .state directories saved atomically with a manifest written last, found, verified
and compared against the current run."""
