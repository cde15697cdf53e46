"""Baton's control plane: the Kopf operator for InferenceDeployment resources."""

__version__ = "0.1.0"
