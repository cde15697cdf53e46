"""The Llama-family decoder over a paged KV cache (`llama`, `config`, `layers`, `rope`,
`weights`), its attention interface and reference backend (`attention`), the Triton kernels of
the GPU path (`kernels`) and checkpoint loading (`loader`).

Kept free of imports: `config` and the torch-free parts of `loader` (model references, GGUF
metadata, tokenizer loading) are imported by the router, which never loads torch.
"""
