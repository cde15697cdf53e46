"""Model references -> files (`reference`), files -> a ready model (`model_loading`: safetensors
or GGUF weights), and a reference's tokenizer without weights (`tokenizer_loading`).

`reference`, `gguf_file`, `gguf_tokenizer` and `tokenizer_loading` are torch-free (the router
reads tokenizers through them); the weight loaders import torch.
"""
