"""The OpenAI-compatible HTTP server of one engine pod (FastAPI + uvicorn)."""
