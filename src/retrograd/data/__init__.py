"""Datasets: JSONL/text readers with file:line errors, chat rendering with loss masks, batching,
and the deterministic, resumable order of rows."""
