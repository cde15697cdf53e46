"""The attention interface the decoder calls (`backend`), a step's row layout (`batch`) and the
torch reference backend (`torch_backend`)."""
