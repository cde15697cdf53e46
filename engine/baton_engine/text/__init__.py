"""Text, torch-free: the tokenizer, chat templates and incremental detokenizing."""
