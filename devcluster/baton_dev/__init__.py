"""A local Kubernetes control plane built from Go modules, for tests and the demo."""

__version__ = "0.1.0"
