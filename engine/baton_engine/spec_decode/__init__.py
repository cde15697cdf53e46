"""Speculative decoding without a draft model: n-gram (prompt-lookup) drafts, verified by the
target model in one forward per step (see `drafter` for how drafts reach the scheduler)."""
