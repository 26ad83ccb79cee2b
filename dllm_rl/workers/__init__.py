"""Rollout workers: bounded-staleness admission (`admission`) and versioned policy snapshots (`versions`)."""
