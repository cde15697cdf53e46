"""What Baton's tests and benchmarks share: the condition waiter (`wait`), the tiny random-weight
model factory (`tiny_models`) and helpers others add. Never imported by the engine, the router or
the operator; benchmarks import this package, never ``tests``."""
