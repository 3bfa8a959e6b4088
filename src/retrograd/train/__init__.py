"""Training loops, one per algorithm family, over shared plumbing in common.py."""
