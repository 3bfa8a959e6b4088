"""`retrograd serve`: a Tinker-compatible training service (see http.py for the entry point)."""
