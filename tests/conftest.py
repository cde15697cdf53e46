"""Shared pytest configuration: the local Kubernetes control plane's fixtures."""

pytest_plugins = ["baton_dev.pytest_plugin"]
