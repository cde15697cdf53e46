"""Coherent P/D rollouts: the KV-compatibility key and the decode-first generation sequencer."""
